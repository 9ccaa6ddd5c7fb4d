# GRU on IRMAS (Sec 4.2 / 5.2): the corpus (download, offline stand-in or an existing folder), the
# MFCC sets of Table 3, exactness checks, per-phase timings over sets x batch sizes (Fig 9) and
# training curves (Fig 13).  Timing and training reuse the generic `bppsa bench` / `bppsa train`.

IRMAS = config["irmas"]
GRU = config["gru"]
GRU_DIR = f"results/{DEVICE}/gru"
GRU_SHAPE = {"s": (259, 38), "m": (517, 24), "l": (1034, 12)}  # Table 3: frames x features
GRU_VARIANTS = ["baseline", "bppsa-fused"]  # the GRU has one Jacobian layout


localrules:
    make_irmas,  # it downloads (irmas.source: download); compute nodes are often offline


rule make_irmas:
    output:
        "data/irmas/corpus.json",
    threads: job_threads("data")
    resources:
        **job_resources("data"),
    params:
        # in params so that changing the source or the stand-in's size reruns the chain
        source=IRMAS["source"],
        clips=IRMAS["synthetic_clips"],
        seed=IRMAS["seed"],
    log:
        "logs/make_irmas.log",
    shell:
        "bppsa make-irmas --source {params.source:q} --root data/irmas --clips {params.clips} --seed {params.seed} "
        "--threads {threads} --out {output} 2> {log}"


rule mfcc:
    input:
        "data/irmas/corpus.json",
    output:
        npz="data/irmas/mfcc_{set}.npz",
        skipped="data/irmas/mfcc_{set}.skipped.txt",
    wildcard_constraints:
        set="s|m|l",
    threads: job_threads("data")
    resources:
        **job_resources("data"),
    params:
        on_bad_file=IRMAS["on_bad_file"],
    log:
        "logs/mfcc/{set}.log",
    shell:
        "bppsa mfcc --corpus {input} --set {wildcards.set} --threads {threads} --on-bad-file {params.on_bad_file} "
        "--out {output.npz} 2> {log}"


rule verify_gru:
    output:
        GRU_DIR + "/verify_{set}_B{B}.json",
    wildcard_constraints:
        set="s|m|l",
        B=r"\d+",
    threads: job_threads("verify")
    resources:
        **job_resources("verify"),
    params:
        args=runtime_args(),
        T=lambda wc: GRU_SHAPE[wc.set][0],
        F=lambda wc: GRU_SHAPE[wc.set][1],
        hidden=GRU["hidden"],
        backend=config["backend"],
    log:
        "logs/verify_gru/{set}_B{B}.log",
    shell:
        "bppsa verify --model gru --seq-len {params.T} --input-size {params.F} --batch {wildcards.B} "
        "--hidden {params.hidden} --layout fused --backend {params.backend} {params.args} --out {output} > {log} 2>&1"


rule bench_gru:
    # every variant of one (set, B), interleaved round by round in one process (README: Timing protocol)
    input:
        data="data/irmas/mfcc_{set}.npz",
        verified=GRU_DIR + "/verify_{set}_B{B}.json",
    output:
        GRU_DIR + "/bench_{set}_B{B}.csv",
    wildcard_constraints:
        set="s|m|l",
        B=r"\d+",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        protocol=bench_args(),
        variants=" ".join(GRU_VARIANTS),
        settings=[GRU["hidden"], GRU["lr"]],  # read by the shell: a change reruns the job
    log:
        "logs/bench_gru/{set}_B{B}.log",
    shell:
        "bppsa bench --model gru --data {input.data} --batch {wildcards.B} --hidden {GRU[hidden]} "
        "--variants {params.variants} --backend {config[backend]} --lr {GRU[lr]} {params.protocol} "
        "--threads {threads} {params.args} --out {output} 2> {log}"


rule speedups_gru:
    input:
        lambda wc: GRU_BENCH,
    output:
        speedups=GRU_DIR + "/speedups.csv",
        latency=GRU_DIR + "/latency.csv",
    resources:
        **job_resources("default"),
    log:
        "logs/speedups_gru.log",
    shell:
        "bppsa speedups {input} --out {output.speedups} --latency-out {output.latency} 2> {log}"


rule train_gru:
    input:
        data="data/irmas/mfcc_{set}.npz",
    output:
        GRU_DIR + "/curve_{set}_{variant}.csv",
    wildcard_constraints:
        set="s|m|l",
        variant="baseline|bppsa-fused",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        method=lambda wc: wc.variant.split("-")[0],
        backend=config["backend"],
        batch=GRU["curves"]["batch"],
        hidden=GRU["hidden"],
        epochs=GRU["curves"]["epochs"],
        lr=GRU["lr"],
    log:
        "logs/train_gru/{set}_{variant}.log",
    shell:
        "bppsa train --model gru --data {input.data} --method {params.method} --layout fused "
        "--backend {params.backend} --batch {params.batch} --hidden {params.hidden} "
        "--epochs {params.epochs} --lr {params.lr} --threads {threads} {params.args} --out {output} 2> {log}"


GRU_BENCH = [GRU_DIR + f"/bench_{s}_B{B}.csv" for s in GRU["sets"] for B in GRU["batches"]]
GRU_SUMMARY = [GRU_DIR + "/speedups.csv", GRU_DIR + "/latency.csv"]
GRU_CURVES = [GRU_DIR + f"/curve_{s}_{v}.csv" for s in GRU["curves"]["sets"] for v in GRU_VARIANTS]
GRU_FIGURES = ["results/fig_9.png", "results/fig_13.png"]


rule figures_gru:
    input:
        GRU_SUMMARY + GRU_CURVES,
    output:
        GRU_FIGURES + ["results/fig_9_data.csv"],
    resources:
        **job_resources("default"),
    log:
        "logs/figures_gru.log",
    shell:
        "bppsa plot-gru --results results --out-dir results 2> {log}"


TARGETS.extend(GRU_SUMMARY + GRU_CURVES + GRU_FIGURES)
