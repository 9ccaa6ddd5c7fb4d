# Shared by every file of workflow/rules/: the device folder, resources, command-line flags, the
# grids, the variant names, the wildcards' constraints, what this configuration measures
# (get_measurements), the figures it draws (get_figures) and the workflow's final outputs
# (get_final_output). Only functions, values and the one wildcard_constraints block, so the order of
# the rule files does not matter; every value comes from the configuration, which checks.smk
# (included before this file) has checked against workflow/schemas/ already.

from pathlib import Path

from bppsa.analysis.report import READS as REPORT_READS
from bppsa.bench.protocol import StopRule
from bppsa.data.irmas import MFCC_SETS
from bppsa.models import SPECS
from bppsa.plots.registry import FIGURES


wildcard_constraints:
    T=r"\d+",
    B=r"\d+",
    set="s|m|l",
    layout="paper|fused",
    variant="baseline|bppsa-(paper|fused)(-compiled)?",
    model="rnn|gru",
    dtype="float32|float64",


def _device_folder():
    """results/<DEVICE>/: the slug the user gave, or, for local runs on the host only, the detected one.

    Snakemake parses this file again inside every cluster job and container, where detection could
    name other hardware than on the host that built the DAG; there the slug must be given.
    """
    if config["device_slug"]:
        return config["device_slug"]
    if IN_CONTAINERS:
        raise WorkflowError(
            "with --use-singularity the config key `device_slug` must be set (e.g. --config device_slug=h100): "
            "the host that parses the Snakefile cannot tell which hardware the containers will see."
        )
    from bppsa import device

    try:
        return device.slug(config["device"])
    except RuntimeError as exc:
        raise WorkflowError(
            f"config key `device` ({config['device']}): {exc}"
        ) from None


DEVICE = _device_folder()
PROFILE = config["profile"]
RESOURCES = config.get("resources", {"default": {"threads": 1}})
# Jobs whose measurements are timings take one unit of this global resource, and so does every job that runs on
# the GPU: the default profile (profiles/default) provides one, so locally no two timings ever share the machine
# and no job (a verify, VGG-11's training) shares the GPU with a measurement. On SLURM timings ask for exclusive
# nodes too (slurm_extra, set in job_resources).
TIMING_CLASSES = ("timing", "cpu_timing")

RNN, GRU, IRMAS = config["rnn"], config["gru"], config["irmas"]
BUDGET = config["bitstream"]["budget"]
VGG, CIFAR, JAC = config["vgg11"], config["cifar10"], config["jacobians"]
# workflow/rules/cnn.smk: Fig 6, the pruned VGG-11 retrained through the scan, the bench-cnn cases
LENET, VGG_SCAN, CNN_BENCH = config["lenet5"], config["vgg11_scan"], config["cnn_bench"]
RESULTS = f"results/{DEVICE}"
RNN_DIR, GRU_DIR, VGG_DIR, JAC_DIR = (
    f"{RESULTS}/{name}" for name in ("rnn", "gru", "vgg11", "jacobians")
)
LENET_DIR = f"{RESULTS}/lenet5"
REPORT, CLAIMS = "results/report.md", "results/claims.md"
CIFAR_MANIFEST = f"{CIFAR['root']}/cifar10.json"
# the set whose generation bitstream_bench measures (config bitstream.budget)
BITSTREAM_BUDGET = f"{RESULTS}/datasets/bitstream_T{BUDGET['seq_len']}.csv"
# The CPU benchmarks (speed, roofline, worker scaling) measure this machine's CPU: only in a cpu folder.
CPU_FOLDER = config["device"] in ("auto", "cpu") and DEVICE == "cpu"

RNN_GRID = sorted(
    {(T, RNN["batch_at_seq_len"]) for T in RNN["seq_lens"]}
    | {(RNN["seq_len_at_batch"], B) for B in RNN["batches"]}
)
RNN_VARIANTS = ["baseline"] + [f"bppsa-{layout}" for layout in RNN["layouts"]]
GRU_VARIANTS = ["baseline"] + [f"bppsa-{layout}" for layout in SPECS["gru"].layouts]


def _job(kind):
    return {**RESOURCES["default"], **RESOURCES.get(kind, {})}


def job_threads(kind):
    return _job(kind).get("threads", 1)


def job_resources(kind):
    """Snakemake resources of a class of job (config `resources`): mem_mb, runtime, gpu, timing."""
    res = {k: v for k, v in _job(kind).items() if k != "threads"}
    if config["device"] == "cpu" or not res.get("gpu"):
        res.pop("gpu", None)  # a CPU run asks the cluster for no GPU
    # a CPU folder's GPU-class jobs run on the CPU: they share no GPU
    if kind in TIMING_CLASSES or ("gpu" in res and DEVICE != "cpu"):
        res["timing"] = 1
    if kind in TIMING_CLASSES:
        res["slurm_extra"] = (
            "'--exclusive'"  # on SLURM a node to itself; other executors ignore it
        )
    return res


def runtime_args(dtype=None):
    """The CLI flags every measuring command gets: device, folder, dtype, profile and seed.

    --results-dir makes the job check that it sees the hardware the folder was claimed for.
    ``dtype`` overrides the configured one (Fig 7's curves in rnn.curves.also_dtypes).
    """
    return (
        f"--device {config['device']} --device-slug {DEVICE} --results-dir {RESULTS} "
        f"--dtype {dtype or config['dtype']} --profile {PROFILE} --seed {config['seed']}"
    )


def get_runtime_args_in_dtype(wildcards):
    """runtime_args() in the precision the {dtype} wildcard names."""
    return runtime_args(wildcards.dtype)


def L_m_arg(value):
    return "none" if value is None else str(value)


def stop_rule(section=None):
    """The timing protocol of config `bench:`, with a CPU benchmark's own caps (min_iters,
    max_seconds) where its section gives them. Built when the Snakefile is read, so a bad value
    stops the run before any job."""
    caps = {
        k: section[k] for k in ("min_iters", "max_seconds") if section and k in section
    }
    return StopRule.from_config({**config["bench"], **caps}, ignore=["packed_baseline"])


def protocol_args(section=None):
    """The stop-rule flags of a timing command (`bppsa bench`, speed, roofline, scaling)."""
    return stop_rule(section).cli_args()


def bench_args():
    """`bppsa bench` flags: the protocol, and whether cuDNN's per-step baseline is timed too."""
    packed = config["bench"]["packed_baseline"]
    packed = {True: "on", False: "off"}.get(
        packed, packed
    )  # YAML 1.1 reads a bare on/off as a boolean
    return f"{protocol_args()} --packed-baseline {packed}"


def get_method_args(wildcards):
    """`--method baseline`, `--method bppsa --layout <layout>` for a variant named bppsa-<layout>, and
    `... --forward auto` for bppsa-<layout>-compiled (BPPSA with the compiled forward, a variant of its own).
    """
    method, _, rest = wildcards.variant.partition("-")
    layout, _, compiled = rest.partition("-")
    return (
        f"--method {method}"
        + (f" --layout {layout}" if layout else "")
        + (" --forward auto" if compiled else "")
    )


def get_rnn_bench():
    return [f"{RNN_DIR}/bench_T{T}_B{B}.csv" for T, B in RNN_GRID]


def get_gru_bench():
    return [
        f"{GRU_DIR}/bench_{s}_B{B}.csv" for s in GRU["sets"] for B in GRU["batches"]
    ]


def get_rnn_summaries():
    return [f"{RNN_DIR}/speedups.csv", f"{RNN_DIR}/latency.csv"]


def get_gru_summaries():
    return [f"{GRU_DIR}/speedups.csv", f"{GRU_DIR}/latency.csv"]


def get_rnn_extra_dtypes():
    """Precisions Fig 7's curves are trained in besides the workflow's dtype (rnn.curves.also_dtypes)."""
    return [d for d in RNN["curves"].get("also_dtypes", []) if d != config["dtype"]]


def get_rnn_curves():
    """Fig 7: baseline and BPPSA (the first layout) in the workflow's dtype, curve_<variant>.csv, and in
    each extra precision, curve_<variant>_<dtype>.csv; with rnn.curves.compiled_forward, on a CPU folder, BPPSA
    with the compiled forward too, in the workflow's dtype (curve_bppsa-<layout>-compiled.csv).
    """
    variants = RNN_VARIANTS[:2]
    compiled = (
        [f"{RNN_VARIANTS[1]}-compiled"]
        if RNN["curves"]["compiled_forward"] and CPU_FOLDER
        else []
    )
    return [f"{RNN_DIR}/curve_{v}.csv" for v in variants + compiled] + [
        f"{RNN_DIR}/curve_{v}_{d}.csv" for d in get_rnn_extra_dtypes() for v in variants
    ]


def get_gru_curves():
    """Fig 13: baseline and BPPSA on every set of gru.curves.sets, curve_<set>_<variant>.csv; on a CPU folder, BPPSA
    with the compiled forward on gru.curves.compiled_forward_sets (curve_<set>_bppsa-fused-compiled.csv).
    """
    compiled = GRU["curves"]["compiled_forward_sets"] if CPU_FOLDER else []
    return [
        f"{GRU_DIR}/curve_{s}_{v}.csv"
        for s in GRU["curves"]["sets"]
        for v in GRU_VARIANTS
        + ([f"{GRU_VARIANTS[1]}-compiled"] if s in compiled else [])
    ]


# The CPU benchmarks' settings per model (config rnn.speed ... gru.scaling).
CPU_BENCH = {"rnn": RNN, "gru": GRU}


def get_cpu_bench_input(kind):
    """The dataset a CPU benchmark of the GRU reads (its MFCC set); the RNN's generates its bitstreams."""

    def inputs(wildcards):
        if wildcards.model == "gru":
            return [f"data/irmas/mfcc_{GRU[kind]['set']}.npz"]
        return []

    return inputs


def get_cpu_bench_args(kind):
    """`--model ...` and the inputs of a CPU benchmark (kind: speed, roofline or scaling)."""

    def args(wildcards):
        if wildcards.model == "gru":
            return f"--model gru --data data/irmas/mfcc_{GRU[kind]['set']}.npz --hidden {GRU['hidden']}"
        if kind == "scaling":
            lens = " ".join(map(str, RNN["scaling"]["seq_lens"]))
            return f"--model rnn --seq-lens {lens} --hidden {RNN['hidden']}"
        return f"--model rnn --seq-len {RNN[kind]['seq_len']} --hidden {RNN['hidden']}"

    return args


def get_cpu_benchmarks():
    """Speed, roofline and scaling of each model, on CPU machines, where its section has batches."""
    out = []
    for model, section in CPU_BENCH.items():
        if not CPU_FOLDER:
            break
        if section["speed"]["batches"]:
            out.append(f"{RESULTS}/{model}/speed.csv")
        if section["roofline"]["batches"]:
            out.append(f"{RESULTS}/{model}/roofline.csv")
        if section["scaling"]["batches"] and section["scaling"].get("seq_lens", True):
            out.append(f"{RESULTS}/{model}/scaling.csv")
    return out


def get_cnn_measurements():
    """Fig 6: LeNet-5's curves in the workflow's dtype and in each of lenet5.also_dtypes; the pruned VGG-11
    retrained through the scan where vgg11_scan.iterations > 0; the bench-cnn cases of cnn_bench.
    """
    dtypes = [config["dtype"]] + [
        d for d in LENET["also_dtypes"] if d != config["dtype"]
    ]
    scan = [f"{VGG_DIR}/retrain_scan.csv", f"{VGG_DIR}/retrain_scan_steps.csv"]
    bench = [
        f"{RESULTS}/cnn/bench_{net}_B{B}.csv"
        for net in ("lenet5", "vgg11")
        for B in CNN_BENCH[f"{net}_batches"]
    ]
    return (
        [f"{LENET_DIR}/curve_{d}.csv" for d in dtypes]
        + (scan if VGG_SCAN["iterations"] else [])
        + bench
    )


def get_cnn_bench_input(wildcards):
    """The data, and for VGG-11 the pruned-retrained checkpoint of vgg11_train."""
    models = {"models": f"{VGG_DIR}/models.pt"} if wildcards.net == "vgg11" else {}
    return {"data": CIFAR_MANIFEST, **models}


def get_cnn_bench_args(wildcards, input):
    """bench-cnn's network flags: VGG-11's checkpoint, and each network's L_m (cnn_bench.<net>_L_m)."""
    models = f"--models {input.models}" if wildcards.net == "vgg11" else ""
    L_m = CNN_BENCH[f"{wildcards.net}_L_m"]
    return f"{models} --L-m {L_m_arg(L_m)}"


def get_lbi_measurements():
    """Latent Bounded Interfaces (workflow/rules/lbi.smk): one training run per model and seed, and the runs on
    ranks; none without the `lbi` section, or with `lbi.r` or `lbi.ranks` empty."""
    lbi = config.get("lbi")
    if not lbi or not lbi["r"] or not lbi["ranks"]:
        return []
    models = ["dense"] + [f"r{r}" for r in lbi["r"]]
    return [
        f"{RESULTS}/lbi/train_{m}_s{s}.csv" for m in models for s in lbi["seeds"]
    ] + [f"{RESULTS}/lbi/traffic.csv", f"{RESULTS}/lbi/backward_time.csv"]


def get_measurements():
    """Every file this configuration measures in its device folder: what the figures, the report and the
    claims read there. The profile's keys gate these; a figure is drawn where what it reads is among them.
    """
    return (
        [f"{RESULTS}/environment.json", BITSTREAM_BUDGET]
        + get_rnn_summaries()
        + get_rnn_curves()
        + get_cpu_benchmarks()
        + get_gru_summaries()
        + get_gru_curves()
        + get_workers()
        + get_lbi_measurements()
        + [
            f"{VGG_DIR}/accuracy.csv",
            f"{VGG_DIR}/flops.csv",
            f"{VGG_DIR}/flops_summary.csv",
            f"{JAC_DIR}/table1_timings.csv",
        ]
        + get_cnn_measurements()
    )


def get_figure_inputs(figure):
    """Input function of a figure's rule: the measured files of this device folder it reads (for its wildcards)."""

    def inputs(wildcards):
        return figure.inputs(get_measurements(), RESULTS, **dict(wildcards.items()))

    return inputs


def get_figure_outputs(figure):
    """A figure's outputs, those with a caption flagged for `snakemake --report` (captions: workflow/report/)."""

    def output(out, path):
        if not out.caption:
            return path
        return report(
            path,
            caption=f"../report/{out.caption}",
            category=out.category,
            subcategory=out.subcategory,
        )

    return [
        output(out, path) for out, path in zip(figure.outputs, figure.paths(DEVICE))
    ]


def get_figures():
    """Every output of every figure this configuration draws (bppsa.plots.registry)."""
    measured = get_measurements()
    return [
        path
        for figure in FIGURES.values()
        for wildcards in figure.instances(measured, RESULTS)
        for path in figure.paths(DEVICE, **wildcards)
    ]


def get_other_devices(*patterns):
    """Input function: the files matching ``patterns`` (relative to a device folder, e.g. "rnn/curve_*.csv")
    in every other device folder, found when the DAG is built.

    The figure, Table 1 and report commands overlay every results/<device>/ folder and every committed
    results/reference/<device>/ one (bppsa's results.device_dirs: every sub-folder of results/ but
    reference/ and hidden ones, then those of results/reference/); declaring what they read there makes
    Snakemake redraw a figure when another device's folder is added or one of its files changes. This
    run's own folder is left out: the rules name its files, those this configuration produces (a stale
    file of an older configuration there is read but not declared, so it never triggers its rule).
    """

    def inputs(wildcards):
        folders = [
            p
            for p in sorted(Path("results").glob("*"))
            if p.is_dir() and p.name != "reference" and not p.name.startswith(".")
        ]
        folders += [
            p for p in sorted(Path("results", "reference").glob("*")) if p.is_dir()
        ]
        return [
            str(f)
            for folder in folders
            if folder != Path(RESULTS)
            for pattern in patterns
            for f in sorted(folder.glob(pattern))
        ]

    return inputs


def get_report_input():
    """Every final output but the report and the claims table, which are rendered from them."""
    return get_measurements() + get_figures()


GPU_MODEL = "results/gpu_model.csv"


def gpu_model_cases():
    """`bppsa gpu-model --case CELL/SEQ_LENS/BATCHES/HIDDEN` arguments: the RNN's two sweeps, the GRU's sets
    (each with its own input size) at its batches."""

    def case(cell, seq_lens, batches, hidden):
        fields = [
            cell,
            ",".join(map(str, seq_lens)),
            ",".join(map(str, batches)),
            str(hidden),
        ]
        return "--case " + "/".join(fields)

    gru_sets = [f"{MFCC_SETS[s].frames}:{MFCC_SETS[s].features}" for s in GRU["sets"]]
    return " ".join(
        [
            case("rnn", RNN["seq_lens"], [RNN["batch_at_seq_len"]], RNN["hidden"]),
            case("rnn", [RNN["seq_len_at_batch"]], RNN["batches"], RNN["hidden"]),
            case("gru", gru_sets, GRU["batches"], GRU["hidden"]),
        ]
    )


def get_final_output():
    """What a plain `snakemake` builds: the inputs of the first target, `all`."""
    return get_report_input() + [REPORT, CLAIMS, GPU_MODEL]


# BPPSA across processes (workflow/rules/workers.smk)
WORKERS = config.get("workers", {"ps": []})


def get_workers():
    """The workers benchmark's CSVs, where the profile lists process counts."""
    if not WORKERS["ps"]:
        return []
    return [f"{RESULTS}/workers/{name}.csv" for name in ("time", "memory", "summary")]
