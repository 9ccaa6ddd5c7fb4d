# RNN experiments (Sec 4.1 / 5.1): exactness checks, per-phase timings over the T and B grids,
# training curves (Fig 7) and the CPU speed benchmark.

RNN = config["rnn"]
RNN_GRID = sorted(
    {(T, RNN["batch_at_seq_len"]) for T in RNN["seq_lens"]}
    | {(RNN["seq_len_at_batch"], B) for B in RNN["batches"]}
)
RNN_VARIANTS = ["baseline"] + [f"bppsa-{layout}" for layout in RNN["layouts"]]
RNN_DIR = f"results/{DEVICE}/rnn"


rule verify_rnn:
    output:
        RNN_DIR + "/verify_T{T}_B{B}_{layout}.json",
    wildcard_constraints:
        T=r"\d+",
        B=r"\d+",
        layout="paper|fused",
    threads: job_threads("verify")
    resources:
        **job_resources("verify"),
    params:
        args=runtime_args(),
        L_m=L_m_arg(RNN["L_m"]),
        hidden=RNN["hidden"],
        backend=config["backend"],
    log:
        "logs/verify_rnn/T{T}_B{B}_{layout}.log",
    shell:
        "bppsa verify --model rnn --seq-len {wildcards.T} --batch {wildcards.B} --hidden {params.hidden} "
        "--layout {wildcards.layout} --backend {params.backend} --L-m {params.L_m} {params.args} "
        "--out {output} > {log} 2>&1"


rule bench_rnn:
    input:
        data="data/bitstream/T{T}.npz",
        verified=lambda wc: [] if wc.variant == "baseline" else RNN_DIR + f"/verify_T{wc.T}_B{wc.B}_{wc.variant.split('-', 1)[1]}.json",
    output:
        RNN_DIR + "/bench_T{T}_B{B}_{variant}.csv",
    wildcard_constraints:
        T=r"\d+",
        B=r"\d+",
        variant="baseline|bppsa-paper|bppsa-fused",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        variant=lambda wc: variant_args(wc.variant, RNN["L_m"]),
        settings=[RNN["hidden"], RNN["lr"], config["bench"]],  # read by the shell: a change reruns the job
    log:
        "logs/bench_rnn/T{T}_B{B}_{variant}.log",
    shell:
        "bppsa bench --model rnn --data {input.data} --batch {wildcards.B} --hidden {RNN[hidden]} "
        "{params.variant} --lr {RNN[lr]} --warmup {config[bench][warmup]} --iters {config[bench][iters]} "
        "--threads {threads} {params.args} --out {output} 2> {log}"


rule train_rnn:
    input:
        data=f"data/bitstream/T{RNN['curves']['seq_len']}.npz",
    output:
        RNN_DIR + "/curve_{variant}.csv",
    wildcard_constraints:
        variant="baseline|bppsa-paper|bppsa-fused",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        method=lambda wc: wc.variant.split("-")[0],
        layout=lambda wc: wc.variant.split("-", 1)[1] if "-" in wc.variant else "fused",
        L_m=L_m_arg(RNN["L_m"]),
        backend=config["backend"],
        batch=RNN["curves"]["batch"],
        hidden=RNN["hidden"],
        epochs=RNN["curves"]["epochs"],
        lr=RNN["lr"],
    log:
        "logs/train_rnn/{variant}.log",
    shell:
        "bppsa train --model rnn --data {input.data} --method {params.method} --layout {params.layout} "
        "--backend {params.backend} --L-m {params.L_m} --batch {params.batch} --hidden {params.hidden} "
        "--epochs {params.epochs} --lr {params.lr} --threads {threads} {params.args} --out {output} 2> {log}"


rule speed_rnn:
    output:
        RNN_DIR + "/speed.csv",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        args=runtime_args(),
        L_m=L_m_arg(RNN["L_m"]),
        settings=[RNN["hidden"], RNN["layouts"], RNN["speed"], config["bench"]],  # read by the shell
    log:
        "logs/speed_rnn.log",
    shell:
        "bppsa speed --device cpu --seq-len {RNN[speed][seq_len]} --batches {RNN[speed][batches]} "
        "--hidden {RNN[hidden]} --layouts {RNN[layouts]} --L-m {params.L_m} "
        "--repeats {config[bench][iters]} --warmup {config[bench][warmup]} --threads {threads} "
        "--profile {PROFILE} --out {output} 2> {log}"


RNN_BENCH = [RNN_DIR + f"/bench_T{T}_B{B}_{v}.csv" for T, B in RNN_GRID for v in RNN_VARIANTS]
RNN_CURVES = [RNN_DIR + f"/curve_{v}.csv" for v in RNN_VARIANTS[:2]]
TARGETS.extend(RNN_BENCH + RNN_CURVES)
if RNN["speed"]["batches"] and config["device"] in ("auto", "cpu") and DEVICE == "cpu":
    TARGETS.append(RNN_DIR + "/speed.csv")
