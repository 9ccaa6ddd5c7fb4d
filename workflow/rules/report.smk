# results/report.md: every measured number on one page; results/claims.md: the paper's claims checked.
# Rendered last, from this run's outputs and from what every other device folder holds: REPORT_READS,
# what report.py's sections and claims.py's rows declare they read in each of them (bppsa.analysis.report.READS).


rule report_render:
    input:
        get_report_input(),
        other_devices=get_other_devices(*REPORT_READS),
    output:
        report=report(
            REPORT,
            caption="../report/report_md.rst",
            category="Claims and report",
            subcategory="Every measured number",
        ),
        claims=report(
            CLAIMS,
            caption="../report/claims_md.rst",
            category="Claims and report",
            subcategory="The paper's claims, checked",
        ),
    log:
        "logs/report_render.log",
    resources:
        **job_resources("default"),
    shell:
        "bppsa report --results results --out {output.report} --claims-out {output.claims} 2> {log}"
