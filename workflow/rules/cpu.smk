# On CPU machines, per model (RNN on bitstreams, GRU on an MFCC set): the speed benchmark (BPPSA's backward
# against eager autograd and the strongest sequential backward, paired; the whole step with torch's forward and
# with the compiled one, at <model>.speed.step_batches), the roofline of the scans, and the
# backward's scaling with worker threads with the extrapolated crossover (Sec 3.6's worker argument),
# drawn by cpu_scaling_plot in figures.smk.


rule cpu_speed:
    input:
        get_cpu_bench_input("speed"),
    output:
        f"{RESULTS}/{{model}}/speed.csv",
    log:
        "logs/cpu_speed/{model}.log",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        model=get_cpu_bench_args("speed"),
        protocol=lambda wc: protocol_args(CPU_BENCH[wc.model]["speed"]),
        batches=lambda wc: CPU_BENCH[wc.model]["speed"]["batches"],
        step_batches=lambda wc: CPU_BENCH[wc.model]["speed"]["step_batches"],
        layouts=lambda wc: RNN["layouts"] if wc.model == "rnn" else ["fused"],
        L_m=L_m_arg(RNN["L_m"]),
        profile=PROFILE,
    shell:
        "bppsa speed --device cpu {params.model} --batches {params.batches} --step-batches {params.step_batches} "
        "--layouts {params.layouts} --L-m {params.L_m} {params.protocol} --threads {threads} "
        "--profile {params.profile} --out {output} 2> {log}"


rule cpu_roofline:
    input:
        get_cpu_bench_input("roofline"),
    output:
        f"{RESULTS}/{{model}}/roofline.csv",
    log:
        "logs/cpu_roofline/{model}.log",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        model=get_cpu_bench_args("roofline"),
        protocol=lambda wc: protocol_args(CPU_BENCH[wc.model]["roofline"]),
        batches=lambda wc: CPU_BENCH[wc.model]["roofline"]["batches"],
        L_m=L_m_arg(RNN["L_m"]),
        dtype=config["dtype"],
        profile=PROFILE,
    shell:
        "bppsa roofline --device cpu {params.model} --batches {params.batches} --L-m {params.L_m} "
        "--dtype {params.dtype} {params.protocol} --threads {threads} --profile {params.profile} --out {output} "
        "2> {log}"


rule cpu_scaling:
    input:
        get_cpu_bench_input("scaling"),
    output:
        f"{RESULTS}/{{model}}/scaling.csv",
    log:
        "logs/cpu_scaling/{model}.log",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        model=get_cpu_bench_args("scaling"),
        protocol=lambda wc: protocol_args(CPU_BENCH[wc.model]["scaling"]),
        batches=lambda wc: CPU_BENCH[wc.model]["scaling"]["batches"],
        dtype=config["dtype"],
        profile=PROFILE,
    shell:
        "bppsa scaling --device cpu {params.model} --batches {params.batches} --dtype {params.dtype} "
        "{params.protocol} --max-threads {threads} --profile {params.profile} --out {output} 2> {log}"
