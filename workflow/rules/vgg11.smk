# Pruned VGG-11 micro-benchmark (Sec 4.3 / 5.3): train, prune, retrain; static FLOP analysis (Fig 10).

VGG = config["vgg11"]
CIFAR = config["cifar10"]
VGG_DIR = f"results/{DEVICE}/vgg11"


rule vgg11_train:
    output:
        models=VGG_DIR + "/models.pt",
        acc=VGG_DIR + "/accuracy.csv",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    params:
        args=runtime_args(),
        augment="" if VGG["augment"] else "--no-augment",
        settings=[VGG, CIFAR],  # read by the shell: a change reruns the job
    log:
        "logs/vgg11/train.log",
    shell:
        "bppsa vgg11-train --source {CIFAR[source]} --data-root {CIFAR[root]} --width {VGG[width]} "
        "--epochs {VGG[epochs]} --retrain-epochs {VGG[retrain_epochs]} --batch-size {VGG[batch_size]} "
        "--lr {VGG[lr]} --weight-decay {VGG[weight_decay]} {params.augment} --prune {VGG[prune][fraction]} "
        "--scheme {VGG[prune][scheme]} --threads {threads} {params.args} "
        "--out-models {output.models} --out {output.acc} > {log} 2>&1"


rule vgg11_flops:
    input:
        VGG_DIR + "/models.pt",
    output:
        flops=VGG_DIR + "/flops.csv",
        summary=VGG_DIR + "/flops_summary.csv",
    threads: job_threads("analysis")
    resources:
        **job_resources("analysis"),
    params:
        L_m=L_m_arg(VGG["flops"]["L_m"]),
        zeros="" if VGG["flops"]["drop_zeros"] else "--keep-zeros",
        networks=" ".join(VGG["flops"]["networks"]),
        slug=f"--device-slug {DEVICE}",
        settings=[VGG["flops"], CIFAR, config["seed"]],  # read by the shell: a change reruns the job
    log:
        "logs/vgg11/flops.log",
    shell:
        "bppsa vgg11-flops --models {input} --source {CIFAR[source]} --data-root {CIFAR[root]} "
        "--samples {VGG[flops][samples]} --L-m {params.L_m} {params.zeros} --networks {params.networks} "
        "--dtype {VGG[flops][dtype]} --dense-limit-gb {VGG[flops][dense_limit_gb]} --device cpu --threads {threads} "
        "--profile {PROFILE} --seed {config[seed]} {params.slug} --out {output.flops} --out-summary {output.summary} > {log} 2>&1"


rule fig10:
    input:
        VGG_DIR + "/flops.csv",
    output:
        "results/fig_10.png",
    resources:
        **job_resources("default"),
    log:
        "logs/vgg11/fig10.log",
    shell:
        "bppsa fig10 --results results --out {output} 2> {log}"


TARGETS.extend([VGG_DIR + "/accuracy.csv", "results/fig_10.png"])
