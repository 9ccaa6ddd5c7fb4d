# results/report.md: every measured number on one page; results/claims.md: the paper's claims checked. Rendered last.

REPORT = "results/report.md"
CLAIMS = "results/claims.md"


rule report:
    input:
        lambda wildcards: [t for t in TARGETS if t not in (REPORT, CLAIMS)],
    output:
        report=REPORT,
        claims=CLAIMS,
    resources:
        **job_resources("default"),
    log:
        "logs/report.log",
    shell:
        "bppsa report --results results --out {output.report} --claims-out {output.claims} 2> {log}"


TARGETS.extend([REPORT, CLAIMS])
