# BPPSA reproduction: `snakemake --cores all` (default, CPU-capable) or
# `snakemake --cores all --configfile config/paper.yaml` (the paper's grids, for a GPU).
# Rules are thin: each calls one `bppsa <command>`; the logic lives in src/bppsa.
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("8.0")

configfile: str(Path(workflow.basedir, "config", "config.yaml"))

# Every section is checked before any job runs; misspelt keys and bad values are named.
for _schema in sorted(Path(workflow.basedir, "workflow", "schemas").glob("*.schema.yaml")):
    validate(config, str(_schema))

# `snakemake --use-singularity` runs every job in this image (build it from docker/Dockerfile)
if config.get("container"):

    container: config["container"]


from bppsa import device as _device  # noqa: E402

DEVICE = config["device_slug"] or _device.slug(config["device"])
PROFILE = config["profile"]
TARGETS = []  # each rule file appends the final outputs it is responsible for


rule all:
    input:
        lambda wildcards: TARGETS,


include: "workflow/rules/common.smk"
include: "workflow/rules/datasets.smk"
include: "workflow/rules/rnn.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/gru.smk"
include: "workflow/rules/jacobians.smk"
include: "workflow/rules/vgg11.smk"
include: "workflow/rules/report.smk"
