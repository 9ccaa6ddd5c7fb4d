# Table 1 (Sec 3.4, Appendix D): guaranteed-zero sparsity and analytic CSR generation vs autograd
# (its text: `bppsa plot table1`, rule table1_plot).


rule table1_bench:
    output:
        f"{JAC_DIR}/table1_timings.csv",
    log:
        "logs/table1_bench.log",
    threads: job_threads("cpu_timing")
    resources:
        **job_resources("cpu_timing"),
    params:
        mkldnn="--mkldnn" if JAC["mkldnn"] else "",
        device=JAC["device"],
        repeats_analytic=JAC["repeats_analytic"],
        repeats_autograd=JAC["repeats_autograd"],
        seed=config["seed"],
        profile=PROFILE,
        slug=DEVICE,
    shell:
        "bppsa jacobians-table1 --repeats-analytic {params.repeats_analytic} "
        "--repeats-autograd {params.repeats_autograd} {params.mkldnn} --device {params.device} --threads {threads} "
        "--profile {params.profile} --seed {params.seed} --device-slug {params.slug} --out {output} > {log} 2>&1"
