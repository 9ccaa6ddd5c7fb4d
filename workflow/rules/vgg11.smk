# Pruned VGG-11 micro-benchmark (Sec 4.3 / 5.3): train, prune, retrain; static FLOP analysis (Fig 10).


rule vgg11_train:
    output:
        models=f"{VGG_DIR}/models.pt",
        acc=f"{VGG_DIR}/accuracy.csv",
    log:
        "logs/vgg11/train.log",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    params:
        args=runtime_args(),
        augment="" if VGG["augment"] else "--no-augment",
        source=CIFAR["source"],
        root=CIFAR["root"],
        width=VGG["width"],
        epochs=VGG["epochs"],
        retrain_epochs=VGG["retrain_epochs"],
        batch_size=VGG["batch_size"],
        lr=VGG["lr"],
        weight_decay=VGG["weight_decay"],
        prune=VGG["prune"]["fraction"],
        scheme=VGG["prune"]["scheme"],
    shell:
        "bppsa vgg11-train --source {params.source} --data-root {params.root} --width {params.width} "
        "--epochs {params.epochs} --retrain-epochs {params.retrain_epochs} --batch-size {params.batch_size} "
        "--lr {params.lr} --weight-decay {params.weight_decay} {params.augment} --prune {params.prune} "
        "--scheme {params.scheme} --threads {threads} {params.args} "
        "--out-models {output.models} --out {output.acc} > {log} 2>&1"


rule vgg11_flops:
    input:
        f"{VGG_DIR}/models.pt",
    output:
        flops=f"{VGG_DIR}/flops.csv",
        summary=f"{VGG_DIR}/flops_summary.csv",
    log:
        "logs/vgg11/flops.log",
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
        source=CIFAR["source"],
        root=CIFAR["root"],
        profile=PROFILE,
        seed=config["seed"],
        slug=DEVICE,
    shell:
        "bppsa vgg11-flops --models {input} --source {params.source} --data-root {params.root} "
        "--samples {params.samples} --L-m {params.L_m} {params.zeros} --networks {params.networks} "
        "--dtype {params.dtype} --dense-limit-gb {params.dense_limit_gb} --device cpu --threads {threads} "
        "--profile {params.profile} --seed {params.seed} --device-slug {params.slug} "
        "--out {output.flops} --out-summary {output.summary} > {log} 2>&1"


rule fig10:
    input:
        f"{VGG_DIR}/flops.csv",
    output:
        "results/fig_10.png",
    log:
        "logs/vgg11/fig10.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa fig10 --results results --out {output} 2> {log}"
