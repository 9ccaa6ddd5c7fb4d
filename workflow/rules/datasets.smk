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
    """Budget of the paper's largest set (T = 30,000, 32,000 samples): time, peak memory, size."""
    output:
        f"{RESULTS}/datasets/bitstream_T30000.csv",
    log:
        "logs/bitstream_bench.log",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    shell:
        "bppsa bench-bitstream --seq-len 30000 --samples 32000 --out {output} 2> {log}"
