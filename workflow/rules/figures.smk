# Every figure and Table 1's text. The RNN, GRU, VGG-11 and Table 1 rules overlay every
# results/<device>/ folder present (committed results/reference/<device>/ ones too), so besides this
# run's files they declare those of every other folder (get_other_devices): a folder added or changed
# redraws them. Each output is in `snakemake --report` under its experiment (captions: workflow/report/).


rule rnn_plot:
    input:
        get_rnn_summaries() + get_rnn_curves(),
        other_devices=get_other_devices(
            "rnn/speedups.csv", "rnn/latency.csv", "rnn/curve_*.csv"
        ),
    output:
        report(
            "results/fig_7.png",
            caption="../report/fig_7.rst",
            category="RNN (Sec 5.1)",
            subcategory="Fig 7: training curves",
        ),
        [
            report(
                f"results/fig_8_{panel}.png",
                caption=f"../report/fig_8_{panel}.rst",
                category="RNN (Sec 5.1)",
                subcategory=(
                    "Fig 8a-c: against T"
                    if panel in "abc"
                    else "Fig 8d-f: against 1/B"
                ),
            )
            for panel in "abcdef"
        ],
    log:
        "logs/rnn_plot.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa plot-rnn --results results --out-dir results 2> {log}"


rule gru_plot:
    input:
        get_gru_summaries() + get_gru_curves(),
        other_devices=get_other_devices(
            "gru/speedups.csv", "gru/latency.csv", "gru/curve_*.csv"
        ),
    output:
        report(
            "results/fig_9.png",
            caption="../report/fig_9.rst",
            category="GRU (Sec 5.2)",
            subcategory="Fig 9: runtime breakdown",
        ),
        report(
            "results/fig_13.png",
            caption="../report/fig_13.rst",
            category="GRU (Sec 5.2)",
            subcategory="Fig 13: training curves",
        ),
        "results/fig_9_data.csv",
    log:
        "logs/gru_plot.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa plot-gru --results results --out-dir results 2> {log}"


rule vgg11_plot:
    input:
        f"{VGG_DIR}/flops.csv",
        other_devices=get_other_devices("vgg11/flops.csv"),
    output:
        report(
            "results/fig_10.png",
            caption="../report/fig_10.rst",
            category="Pruned VGG-11 (Sec 5.3)",
            subcategory="Fig 10: FLOP per step",
        ),
    log:
        "logs/vgg11_plot.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa fig10 --results results --out {output} 2> {log}"


rule table1_render:
    input:
        f"{JAC_DIR}/table1_timings.csv",
        other_devices=get_other_devices("jacobians/table1*.csv"),
    output:
        report(
            "results/table_1_last_column.txt",
            caption="../report/table_1.rst",
            category="Sparse Jacobians (Sec 3.4)",
            subcategory="Table 1",
        ),
    log:
        "logs/table1_render.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa table1 --results results --out {output} 2> {log}"


# On CPU machines only (get_cpu_benchmarks): one figure per model, from this machine's scaling.csv alone.
rule cpu_scaling_plot:
    input:
        f"{RESULTS}/{{model}}/scaling.csv",
    output:
        fig=report(
            f"{RESULTS}/fig_scaling_{{model}}.png",
            caption="../report/fig_scaling.rst",
            category="CPU benchmarks",
            subcategory="Worker scaling: {model}",
        ),
        crossover=f"{RESULTS}/{{model}}/scaling_crossover.csv",
    log:
        "logs/cpu_scaling_plot/{model}.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa plot-scaling {input} --out {output.fig} --crossover {output.crossover} 2> {log}"
