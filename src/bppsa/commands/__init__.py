"""Sub-commands of the `bppsa` CLI; each module exposes ``register(subparsers)``.

:data:`MODULES` says which module defines which commands, so that ``bppsa COMMAND`` imports that module
alone: a job that draws a figure or reads CSVs then starts without torch (about 1.5 s of a job's start).
``tests/test_cli.py`` holds the table to what the modules register.
"""

MODULES = {
    "cnn": ("lenet5-curves", "bench-cnn", "vgg11-retrain-scan"),
    "datasets": ("make-bitstream", "bench-bitstream"),
    "doctor": ("doctor", "device"),
    "gpu": ("gpu-model", "gpu-measured", "bench-membound"),
    "irmas": ("make-irmas", "mfcc"),
    "jacobians": ("jacobians-table1",),
    "lbi": ("lbi-train", "lbi-ranks"),
    "plots": ("plot",),
    "recurrent": ("verify", "bench", "train"),
    "report": ("speedups", "compare-speedups", "report"),
    "roofline": ("roofline",),
    "scaling": ("scaling",),
    "shapes": ("paper-shapes",),
    "speed": ("speed",),
    "vgg11": ("make-cifar10", "vgg11-train", "vgg11-flops"),
    "workers": ("workers",),
}
