# Pruned VGG-11 micro-benchmark (Sec 4.3 / 5.3): train, prune, retrain; static FLOP analysis (Fig 10, drawn
# by vgg11_plot in figures.smk).


localrules:
    cifar10_make,  # it downloads (cifar10.source: download); no job that asks for a GPU touches the network


rule cifar10_make:
    output:
        CIFAR_MANIFEST,
    log:
        "logs/cifar10_make.log",
    resources:
        **job_resources("data"),
    params:
        # in params so that changing the source or the mirror reruns it
        source=CIFAR["source"],
        root=lambda wildcards, output: Path(output[0]).parent,  # cifar10.root
        url=CIFAR["url"],
        md5=CIFAR["md5"],
    shell:
        "bppsa make-cifar10 --source {params.source:q} --root {params.root:q} --url {params.url:q} "
        "--md5 {params.md5:q} --out {output} 2> {log}"


rule vgg11_train:
    input:
        CIFAR_MANIFEST,
    output:
        models=f"{VGG_DIR}/models.pt",
        acc=f"{VGG_DIR}/accuracy.csv",
    log:
        "logs/vgg11_train.log",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    params:
        args=runtime_args(),
        augment="" if VGG["augment"] else "--no-augment",
        width=VGG["width"],
        epochs=VGG["epochs"],
        retrain_epochs=VGG["retrain_epochs"],
        batch_size=VGG["batch_size"],
        lr=VGG["lr"],
        weight_decay=VGG["weight_decay"],
        prune=VGG["prune"]["fraction"],
        scheme=VGG["prune"]["scheme"],
    shell:
        "bppsa vgg11-train --data {input:q} --width {params.width} "
        "--epochs {params.epochs} --retrain-epochs {params.retrain_epochs} --batch-size {params.batch_size} "
        "--lr {params.lr} --weight-decay {params.weight_decay} {params.augment} --prune {params.prune} "
        "--scheme {params.scheme} --threads {threads} {params.args} "
        "--out-models {output.models} --out {output.acc} > {log} 2>&1"


rule vgg11_flops:
    input:
        models=f"{VGG_DIR}/models.pt",
        data=CIFAR_MANIFEST,
    output:
        flops=f"{VGG_DIR}/flops.csv",
        summary=f"{VGG_DIR}/flops_summary.csv",
    log:
        "logs/vgg11_flops.log",
    threads: job_threads("analysis")
    resources:
        **job_resources("analysis"),
    params:
        L_m=L_m_arg(VGG["flops"]["L_m"]),
        zeros="" if VGG["flops"]["drop_zeros"] else "--keep-zeros",
        networks=" ".join(VGG["flops"]["networks"]),
        samples=VGG["flops"]["samples"],
        dtype=VGG["flops"]["dtype"],
        dense_limit_gb=VGG["flops"]["dense_limit_gb"],
        profile=PROFILE,
        seed=config["seed"],
        slug=DEVICE,
    shell:
        "bppsa vgg11-flops --models {input.models:q} --data {input.data:q} "
        "--samples {params.samples} --L-m {params.L_m} {params.zeros} --networks {params.networks} "
        "--dtype {params.dtype} --dense-limit-gb {params.dense_limit_gb} --device cpu --threads {threads} "
        "--profile {params.profile} --seed {params.seed} --device-slug {params.slug} "
        "--out {output.flops} --out-summary {output.summary} > {log} 2>&1"
