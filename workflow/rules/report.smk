# results/report.md: every measured number on one page, rendered last.

REPORT = "results/report.md"


rule report:
    input:
        lambda wildcards: [t for t in TARGETS if t != REPORT],
    output:
        REPORT,
    resources:
        **job_resources("default"),
    log:
        "logs/report.log",
    shell:
        "bppsa report --results results --out {output} 2> {log}"


TARGETS.append(REPORT)
