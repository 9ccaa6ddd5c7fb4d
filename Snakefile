# BPPSA reproduction: `snakemake --cores all` (default, CPU-capable) or
# `snakemake --cores all --configfile config/paper.yaml` (the paper's grids, for a GPU);
# on a cluster `snakemake --profile profiles/slurm --configfile config/paper.yaml --config device_slug=h100`.
# Rules are thin: each calls one `bppsa <command>`; the logic lives in src/bppsa. Rule names are
# <object>_<step> (rnn_bench, gru_plot, irmas_make ...); the checks run first, before any rule is read.
from pathlib import Path


configfile: str(Path(workflow.basedir, "config", "config.yaml"))


report: "workflow/report/workflow.rst"


include: "workflow/rules/checks.smk"
include: "workflow/rules/common.smk"


rule all:
    input:
        get_final_output(),


include: "workflow/rules/environment.smk"
include: "workflow/rules/datasets.smk"
include: "workflow/rules/rnn.smk"
include: "workflow/rules/gru.smk"
include: "workflow/rules/cpu.smk"
include: "workflow/rules/jacobians.smk"
include: "workflow/rules/gpu.smk"
include: "workflow/rules/vgg11.smk"
include: "workflow/rules/cnn.smk"
include: "workflow/rules/workers.smk"
include: "workflow/rules/lbi.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/report.smk"
