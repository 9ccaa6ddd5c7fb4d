# Table 1 (Sec 3.4, Appendix D): guaranteed-zero sparsity and analytic CSR generation vs autograd.

JAC = config["jacobians"]
JAC_DIR = f"results/{DEVICE}/jacobians"


rule table1_timings:
    output:
        JAC_DIR + "/table1_timings.csv",
    threads: workflow.cores  # timings never share the machine with another job
    params:
        mkldnn="--mkldnn" if JAC["mkldnn"] else "",
    log:
        "logs/jacobians/table1_timings.log",
    shell:
        "bppsa jacobians-table1 --repeats-analytic {JAC[repeats_analytic]} --repeats-autograd {JAC[repeats_autograd]} "
        "{params.mkldnn} --device {JAC[device]} --threads {threads} --profile {PROFILE} --seed {config[seed]} "
        "--device-slug {DEVICE} --out {output} > {log} 2>&1"


rule table1_text:
    input:
        JAC_DIR + "/table1_timings.csv",
    output:
        "results/table_1_last_column.txt",
    log:
        "logs/jacobians/table1_text.log",
    shell:
        "bppsa table1 --results results --out {output} 2> {log}"


TARGETS.append("results/table_1_last_column.txt")
