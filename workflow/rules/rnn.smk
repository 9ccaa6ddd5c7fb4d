# RNN experiments (Sec 4.1 / 5.1): per-phase timings, each after its exactness check, over the T and B grids and
# training curves (Fig 7); the CPU benchmarks of both models are in cpu.smk, the figures in
# figures.smk.


rule rnn_bench:
    # every variant of one (T, B), interleaved round by round in one process (docs/timing.md), after each BPPSA
    # layout's gradient check against autograd in the same process (verify_*.json; a failed check stops the job
    # before any timing)
    input:
        data="data/bitstream/T{T}.npz",
    output:
        csv=f"{RNN_DIR}/bench_T{{T}}_B{{B}}.csv",
        verified=expand(
            f"{RNN_DIR}/verify_T{{{{T}}}}_B{{{{B}}}}_{{layout}}.json",
            layout=RNN["layouts"],
        ),
    log:
        "logs/rnn_bench/T{T}_B{B}.log",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        protocol=bench_args(),
        variants=" ".join(RNN_VARIANTS),
        L_m=L_m_arg(RNN["L_m"]),
        hidden=RNN["hidden"],
        lr=RNN["lr"],
        backend=config["backend"],
    shell:
        "bppsa bench --model rnn --data {input.data} --batch {wildcards.B} --hidden {params.hidden} "
        "--variants {params.variants} --backend {params.backend} --L-m {params.L_m} --lr {params.lr} "
        "{params.protocol} --threads {threads} {params.args} --verify-out {output.verified} --out {output.csv} "
        "2> {log}"


rule rnn_speedups:
    input:
        get_rnn_bench(),
    output:
        speedups=f"{RNN_DIR}/speedups.csv",
        latency=f"{RNN_DIR}/latency.csv",
    log:
        "logs/rnn_speedups.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa speedups {input} --out {output.speedups} --latency-out {output.latency} 2> {log}"


rule rnn_train:
    input:
        data=f"data/bitstream/T{RNN['curves']['seq_len']}.npz",
    output:
        f"{RNN_DIR}/curve_{{variant}}.csv",
    log:
        "logs/rnn_train/{variant}.log",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        method=get_method_args,
        L_m=L_m_arg(RNN["L_m"]),
        backend=config["backend"],
        batch=RNN["curves"]["batch"],
        hidden=RNN["hidden"],
        epochs=RNN["curves"]["epochs"],
        lr=RNN["lr"],
    shell:
        "bppsa train --model rnn --data {input.data} {params.method} "
        "--backend {params.backend} --L-m {params.L_m} --batch {params.batch} --hidden {params.hidden} "
        "--epochs {params.epochs} --lr {params.lr} --threads {threads} {params.args} --out {output} 2> {log}"


# Fig 7's curves again in another precision (rnn.curves.also_dtypes): in float64 exact gradients keep the two
# curves together far longer, which tells float32 round-off amplified by training from a wrong gradient.
use rule rnn_train as rnn_train_in_dtype with:
    output:
        f"{RNN_DIR}/curve_{{variant}}_{{dtype}}.csv",
    log:
        "logs/rnn_train_in_dtype/{variant}_{dtype}.log",
    params:
        args=get_runtime_args_in_dtype,
