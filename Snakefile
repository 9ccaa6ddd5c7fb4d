# BPPSA reproduction: `snakemake --cores all` (default, CPU-capable) or
# `snakemake --cores all --configfile config/paper.yaml` (the paper's grids, for a GPU);
# on a cluster `snakemake --profile profiles/slurm --configfile config/paper.yaml --config device_slug=h100`.
# Rules are thin: each calls one `bppsa <command>`; the logic lives in src/bppsa.
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import min_version, validate

min_version("8.0")

configfile: str(Path(workflow.basedir, "config", "config.yaml"))

# Every section is checked before any job runs; misspelt keys and bad values are named.
for _schema in sorted(Path(workflow.basedir, "workflow", "schemas").glob("*.schema.yaml")):
    validate(config, str(_schema))

# --use-singularity (an alias of --use-apptainer) must never run a job on the host.
IN_CONTAINERS = DeploymentMethod.APPTAINER in workflow.deployment_settings.deployment_method
BUILD_IMAGE = "apptainer build --build-arg BPPSA_TORCH_CUDA=12 bppsa.sif docker/bppsa.def"
if IN_CONTAINERS and not config.get("container"):
    raise WorkflowError(
        "--use-singularity/--use-apptainer is set but the config key `container` names no image, so every job "
        f"would run on the host. Build the image (BPPSA_TORCH_CUDA: 12 or 13, what the nodes' driver supports; "
        f"cpu without a GPU):\n    {BUILD_IMAGE}\nthen add `--config container=bppsa.sif device_slug=<name>`."
    )
if config.get("container"):

    container: config["container"]


def _device_folder():
    """results/<DEVICE>/: the slug the user gave, or, for local runs on the host only, the detected one.

    Snakemake parses this file again inside every cluster job and container, where detection could
    name other hardware than on the host that built the DAG; there the slug must be given.
    """
    if config["device_slug"]:
        return config["device_slug"]
    if IN_CONTAINERS:
        raise WorkflowError(
            "with --use-singularity the config key `device_slug` must be set (e.g. --config device_slug=h100): "
            "the host that parses the Snakefile cannot tell which hardware the containers will see."
        )
    from bppsa import device

    try:
        return device.slug(config["device"])
    except RuntimeError as exc:
        raise WorkflowError(f"config key `device` ({config['device']}): {exc}") from None


DEVICE = _device_folder()
PROFILE = config["profile"]
TARGETS = []  # each rule file appends the final outputs it is responsible for


onstart:
    # the executor is only known once the DAG is built, so this check runs here, still before any job
    if not workflow.local_exec and not config["device_slug"]:
        raise WorkflowError(
            "this run submits jobs to other machines, so the config key `device_slug` must be set "
            f"(e.g. --config device_slug=h100); the detected '{DEVICE}' is the submitting host's hardware."
        )


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
