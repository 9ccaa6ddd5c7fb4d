# Helpers shared by the rule files.

RESOURCES = config.get("resources", {"default": {"threads": 1}})
# Jobs whose measurements are timings take one unit of this global resource; the default profile
# (profiles/default) provides one, so locally no two timings ever share the machine. On SLURM the
# profile gives them exclusive nodes instead.
TIMING_CLASSES = ("timing", "cpu_timing")


def _job(kind):
    return {**RESOURCES["default"], **RESOURCES.get(kind, {})}


def job_threads(kind):
    return _job(kind).get("threads", 1)


def job_resources(kind):
    """Snakemake resources of a class of job (config `resources`): mem_mb, runtime, gpu, timing."""
    res = {k: v for k, v in _job(kind).items() if k != "threads"}
    if config["device"] == "cpu" or not res.get("gpu"):
        res.pop("gpu", None)  # a CPU run asks the cluster for no GPU
    if kind in TIMING_CLASSES:
        res["timing"] = 1
    return res


def runtime_args():
    """The CLI flags every measuring command gets: device, folder, dtype, profile and seed.

    --results-dir makes the job check that it sees the hardware the folder was claimed for.
    """
    return (f"--device {config['device']} --device-slug {DEVICE} --results-dir results/{DEVICE} "
            f"--dtype {config['dtype']} --profile {PROFILE} --seed {config['seed']}")


def L_m_arg(value):
    return "none" if value is None else str(value)


def variant_args(variant, L_m=None):
    """`bppsa bench` flags of a variant: 'baseline' or 'bppsa-<layout>'."""
    if variant == "baseline":
        return "--methods baseline"
    return f"--methods bppsa --layout {variant.split('-', 1)[1]} --backend {config['backend']} --L-m {L_m_arg(L_m)}"


rule environment:
    output:
        f"results/{DEVICE}/environment.json",
    threads: job_threads("verify")
    resources:
        **job_resources("verify"),
    params:
        device=config["device"],
    shell:
        "bppsa device --device {params.device} --device-slug {DEVICE} --results-dir results/{DEVICE} --json "
        "> {output}.tmp && mv {output}.tmp {output}"


TARGETS.append(f"results/{DEVICE}/environment.json")
