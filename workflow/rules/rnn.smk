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
    # every variant of one (T, B), interleaved round by round in one process (README: Timing protocol)
    input:
        data="data/bitstream/T{T}.npz",
        verified=expand(RNN_DIR + "/verify_T{{T}}_B{{B}}_{layout}.json", layout=RNN["layouts"]),
    output:
        RNN_DIR + "/bench_T{T}_B{B}.csv",
    wildcard_constraints:
        T=r"\d+",
        B=r"\d+",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        protocol=bench_args(),
        variants=" ".join(RNN_VARIANTS),
        L_m=L_m_arg(RNN["L_m"]),
        settings=[RNN["hidden"], RNN["lr"]],  # read by the shell: a change reruns the job
    log:
        "logs/bench_rnn/T{T}_B{B}.log",
    shell:
        "bppsa bench --model rnn --data {input.data} --batch {wildcards.B} --hidden {RNN[hidden]} "
        "--variants {params.variants} --backend {config[backend]} --L-m {params.L_m} --lr {RNN[lr]} "
        "{params.protocol} --threads {threads} {params.args} --out {output} 2> {log}"


rule speedups_rnn:
    input:
        lambda wc: RNN_BENCH,
    output:
        speedups=RNN_DIR + "/speedups.csv",
        latency=RNN_DIR + "/latency.csv",
    resources:
        **job_resources("default"),
    log:
        "logs/speedups_rnn.log",
    shell:
        "bppsa speedups {input} --out {output.speedups} --latency-out {output.latency} 2> {log}"


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
        rule=lambda wc: protocol_args(RNN["speed"]),
        L_m=L_m_arg(RNN["L_m"]),
        settings=[RNN["hidden"], RNN["layouts"], RNN["speed"], config["bench"]],  # read by the shell
    log:
        "logs/speed_rnn.log",
    shell:
        "bppsa speed --device cpu --seq-len {RNN[speed][seq_len]} --batches {RNN[speed][batches]} "
        "--hidden {RNN[hidden]} --layouts {RNN[layouts]} --L-m {params.L_m} {params.rule} "
        "--threads {threads} --profile {PROFILE} --out {output} 2> {log}"


RNN_BENCH = [RNN_DIR + f"/bench_T{T}_B{B}.csv" for T, B in RNN_GRID]
RNN_SUMMARY = [RNN_DIR + "/speedups.csv", RNN_DIR + "/latency.csv"]
RNN_CURVES = [RNN_DIR + f"/curve_{v}.csv" for v in RNN_VARIANTS[:2]]
TARGETS.extend(RNN_SUMMARY + RNN_CURVES)
if RNN["speed"]["batches"] and config["device"] in ("auto", "cpu") and DEVICE == "cpu":
    TARGETS.append(RNN_DIR + "/speed.csv")


# CPU roofline of the scan and the scaling of the backward with worker threads (1 .. all cores).


def protocol_args(section):
    """Stop-rule flags of a timing command: warm-up from bench:, the caps from the experiment's section."""
    warmup = config["bench"].get("warmup", 3)
    return f"--warmup {warmup} --min-iters {section['min_iters']} --max-seconds {section['max_seconds']}"


rule roofline_rnn:
    output:
        RNN_DIR + "/roofline.csv",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        rule=lambda wc: protocol_args(RNN["roofline"]),
        L_m=L_m_arg(RNN["L_m"]),
        settings=[RNN["hidden"], RNN["roofline"], config["dtype"]],  # read by the shell: a change reruns the job
    log:
        "logs/roofline_rnn.log",
    shell:
        "bppsa roofline --device cpu --seq-len {RNN[roofline][seq_len]} --batches {RNN[roofline][batches]} "
        "--hidden {RNN[hidden]} --L-m {params.L_m} --dtype {config[dtype]} {params.rule} --threads {threads} "
        "--profile {PROFILE} --out {output} 2> {log}"


rule scaling_rnn:
    output:
        RNN_DIR + "/scaling.csv",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        rule=lambda wc: protocol_args(RNN["scaling"]),
        settings=[RNN["hidden"], RNN["scaling"], config["dtype"]],  # read by the shell: a change reruns the job
    log:
        "logs/scaling_rnn.log",
    shell:
        "bppsa scaling --device cpu --seq-lens {RNN[scaling][seq_lens]} --batches {RNN[scaling][batches]} "
        "--hidden {RNN[hidden]} --dtype {config[dtype]} {params.rule} --max-threads {threads} "
        "--profile {PROFILE} --out {output} 2> {log}"


rule figure_scaling:
    input:
        RNN_DIR + "/scaling.csv",
    output:
        fig=f"results/{DEVICE}/fig_scaling.png",
        crossover=RNN_DIR + "/scaling_crossover.csv",
    resources:
        **job_resources("default"),
    log:
        "logs/figure_scaling.log",
    shell:
        "bppsa plot-scaling {input} --out {output.fig} --crossover {output.crossover} 2> {log}"


if config["device"] in ("auto", "cpu") and DEVICE == "cpu":
    if RNN["roofline"]["batches"]:
        TARGETS.append(RNN_DIR + "/roofline.csv")
    if RNN["scaling"]["seq_lens"] and RNN["scaling"]["batches"]:
        TARGETS.extend([f"results/{DEVICE}/fig_scaling.png", RNN_DIR + "/scaling_crossover.csv"])
