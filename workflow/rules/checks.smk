# Included first: the checks that stop a run before any job. The configuration against
# workflow/schemas/, the container settings, and (onstart) the device slug of runs that submit jobs.
# Also first: a lock left by a killed run (SIGKILL, a lost node, a walltime) is removed, and only
# when its owner is known to be gone (bppsa.runlock), so the same command resumes the run.
from pathlib import Path

from bppsa.runlock import clear_stale_lock, record_owner
from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import min_version, validate

min_version("8.0")

if workflow.is_main_process and (_cleared := clear_stale_lock()):
    logger.warning(_cleared)

# Every section is checked before any job runs; misspelt keys and bad values are named.
for _schema in sorted(
    Path(workflow.basedir, "workflow", "schemas").glob("*.schema.yaml")
):
    validate(config, str(_schema))

# A key the schemas cannot relate to another: the compiled-forward curves' sets must be curves' sets.
_stray = sorted(
    set(config["gru"]["curves"]["compiled_forward_sets"])
    - set(config["gru"]["curves"]["sets"])
)
if _stray:
    raise WorkflowError(
        f"config key gru.curves.compiled_forward_sets: {_stray} not among gru.curves.sets "
        f"{config['gru']['curves']['sets']}: the compiled forward's curve is drawn beside the others of its set."
    )

# --use-singularity (an alias of --use-apptainer) must never run a job on the host.
IN_CONTAINERS = (
    DeploymentMethod.APPTAINER in workflow.deployment_settings.deployment_method
)
BUILD_IMAGE = (
    "apptainer build --build-arg BPPSA_TORCH_CUDA=12 bppsa.sif docker/bppsa.def"
)
if IN_CONTAINERS and not config.get("container"):
    raise WorkflowError(
        "--use-singularity/--use-apptainer is set but the config key `container` names no image, so every job "
        f"would run on the host. Build the image (BPPSA_TORCH_CUDA: 12 or 13, what the nodes' driver supports; "
        f"cpu without a GPU):\n    {BUILD_IMAGE}\nthen add `--config container=bppsa.sif device_slug=<name>`."
    )
if (
    IN_CONTAINERS
    and config["container"].endswith(".sif")
    and not Path(config["container"]).is_file()
):
    raise WorkflowError(
        f"the config key `container` names the image {config['container']}, which is not here. Build it "
        f"(BPPSA_TORCH_CUDA: 12 or 13, what the nodes' driver supports; cpu without a GPU):\n    {BUILD_IMAGE}"
    )
if config.get("container"):

    container: config["container"]


onstart:
    # Snakemake holds its lock now (onstart runs in real runs only): record who, for clear_stale_lock
    if workflow.execution_settings.lock:
        record_owner()
    # the executor is only known once the DAG is built, so this check runs here, still before any job
    if not workflow.local_exec and not config["device_slug"]:
        raise WorkflowError(
            "this run submits jobs to other machines, so the config key `device_slug` must be set "
            f"(e.g. --config device_slug=h100); the detected '{DEVICE}' is the submitting host's hardware."
        )
