# Figures of the RNN experiments; they overlay every results/<device>/ folder present
# (including committed results/reference/<device>/ ones).


rule figures_rnn:
    input:
        get_rnn_summaries() + get_rnn_curves(),
    output:
        ["results/fig_7.png"] + [f"results/fig_8_{panel}.png" for panel in "abcdef"],
    log:
        "logs/figures_rnn.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa plot-rnn --results results --out-dir results 2> {log}"
