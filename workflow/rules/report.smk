# results/report.md: every measured number on one page; results/claims.md: the paper's claims checked.
# Rendered last.


rule report_render:
    input:
        get_report_input(),
    output:
        report=REPORT,
        claims=CLAIMS,
    log:
        "logs/report_render.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa report --results results --out {output.report} --claims-out {output.claims} 2> {log}"
