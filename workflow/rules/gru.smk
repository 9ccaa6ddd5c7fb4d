# GRU on IRMAS (Sec 4.2 / 5.2): the corpus (download, offline stand-in or an existing folder), the
# MFCC sets of Table 3, exactness checks, per-phase timings over sets x batch sizes (Fig 9) and
# training curves (Fig 13).  Timing and training reuse the generic `bppsa bench` / `bppsa train`;
# the figures are in figures.smk.


localrules:
    irmas_make,  # it downloads (irmas.source: download); compute nodes are often offline


rule irmas_make:
    output:
        "data/irmas/corpus.json",
    log:
        "logs/irmas_make.log",
    threads: job_threads("data")
    resources:
        **job_resources("data"),
    params:
        # in params so that changing the source or the stand-in's size reruns the chain
        source=IRMAS["source"],
        url=IRMAS["url"],
        md5=IRMAS["md5"],
        clips=IRMAS["synthetic_clips"],
        seed=IRMAS["seed"],
    shell:
        "bppsa make-irmas --source {params.source:q} --url {params.url:q} --md5 {params.md5:q} --root data/irmas "
        "--clips {params.clips} --seed {params.seed} --threads {threads} --out {output} 2> {log}"


rule irmas_mfcc:
    input:
        "data/irmas/corpus.json",
    output:
        npz="data/irmas/mfcc_{set}.npz",
        skipped="data/irmas/mfcc_{set}.skipped.txt",
    log:
        "logs/irmas_mfcc/{set}.log",
    threads: job_threads("data")
    resources:
        **job_resources("data"),
    params:
        on_bad_file=IRMAS["on_bad_file"],
    shell:
        "bppsa mfcc --corpus {input} --set {wildcards.set} --threads {threads} --on-bad-file {params.on_bad_file} "
        "--out {output.npz} 2> {log}"


rule gru_bench:
    # every variant of one (set, B), interleaved round by round in one process (docs/timing.md), after the BPPSA
    # variant's gradient check against autograd in the same process (verify_*.json)
    input:
        data="data/irmas/mfcc_{set}.npz",
    output:
        csv=f"{GRU_DIR}/bench_{{set}}_B{{B}}.csv",
        verified=f"{GRU_DIR}/verify_{{set}}_B{{B}}.json",
    log:
        "logs/gru_bench/{set}_B{B}.log",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        protocol=bench_args(),
        variants=" ".join(GRU_VARIANTS),
        hidden=GRU["hidden"],
        lr=GRU["lr"],
        backend=config["backend"],
    shell:
        "bppsa bench --model gru --data {input.data} --batch {wildcards.B} --hidden {params.hidden} "
        "--variants {params.variants} --backend {params.backend} --lr {params.lr} {params.protocol} "
        "--threads {threads} {params.args} --verify-out {output.verified} --out {output.csv} 2> {log}"


rule gru_speedups:
    input:
        get_gru_bench(),
    output:
        speedups=f"{GRU_DIR}/speedups.csv",
        latency=f"{GRU_DIR}/latency.csv",
    log:
        "logs/gru_speedups.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa speedups {input} --out {output.speedups} --latency-out {output.latency} 2> {log}"


rule gru_train:
    input:
        data="data/irmas/mfcc_{set}.npz",
    output:
        f"{GRU_DIR}/curve_{{set}}_{{variant}}.csv",
    log:
        "logs/gru_train/{set}_{variant}.log",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        method=get_method_args,
        backend=config["backend"],
        batch=GRU["curves"]["batch"],
        hidden=GRU["hidden"],
        epochs=GRU["curves"]["epochs"],
        lr=GRU["lr"],
    shell:
        "bppsa train --model gru --data {input.data} {params.method} "
        "--backend {params.backend} --batch {params.batch} --hidden {params.hidden} "
        "--epochs {params.epochs} --lr {params.lr} --threads {threads} {params.args} --out {output} 2> {log}"
