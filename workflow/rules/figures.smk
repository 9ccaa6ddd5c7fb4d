# Every figure and Table 1's text: one rule `<name>_plot` per declaration of bppsa.plots.registry.FIGURES (its
# inputs, outputs, log and captions all come from there; add a figure there, not here). A figure that overlays
# every results/<device>/ folder (committed results/reference/<device>/ ones too) declares, besides this run's
# files, those of every other folder (get_other_devices): a folder added or changed redraws it. Each output
# with a caption is in `snakemake --report` under its experiment (captions: workflow/report/).


for figure in FIGURES.values():

    rule:
        name:
            figure.rule
        input:
            reads=get_figure_inputs(figure),
            other_devices=get_other_devices(*figure.reads) if figure.overlay else [],
        output:
            get_figure_outputs(figure),
        log:
            figure.log,
        resources:
            **job_resources("default"),
        params:
            # the shell command is formatted when the job runs, after the loop: its values come in params
            figure=figure.name,
        shell:
            "bppsa plot {params.figure} --results results --input {input.reads} --out {output} 2> {log}"
