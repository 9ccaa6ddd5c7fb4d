# Bitstream datasets of Sec 4.1 (Eq. 8): one file per sequence length.


rule bitstream_make:
    output:
        "data/bitstream/T{T}.npz",
    log:
        "logs/bitstream_make/T{T}.log",
    threads: 1
    resources:
        **job_resources("data"),
    params:
        samples=config["bitstream"]["samples"],
        seed=config["bitstream"]["seed"],
    shell:
        "bppsa make-bitstream --seq-len {wildcards.T} --samples {params.samples} --seed {params.seed} "
        "--out {output} 2> {log}"


rule bitstream_bench:
    """Budget of one set (config bitstream.budget; the paper's largest: T = 30,000, 32,000 samples): time,
    peak memory, size."""
    output:
        BITSTREAM_BUDGET,
    log:
        "logs/bitstream_bench.log",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        seq_len=BUDGET["seq_len"],
        samples=BUDGET["samples"],
    shell:
        "bppsa bench-bitstream --seq-len {params.seq_len} --samples {params.samples} --out {output} 2> {log}"
