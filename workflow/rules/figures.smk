# Figures of the RNN experiments; they overlay every results/<device>/ folder present
# (including committed results/reference/<device>/ ones).

RNN_FIGURES = ["results/fig_7.png"] + [f"results/fig_8_{p}.png" for p in "abcdef"]


rule figures_rnn:
    input:
        RNN_SUMMARY + RNN_CURVES,
    output:
        RNN_FIGURES,
    resources:
        **job_resources("default"),
    log:
        "logs/figures_rnn.log",
    shell:
        "bppsa plot-rnn --results results --out-dir results 2> {log}"


TARGETS.extend(RNN_FIGURES)
