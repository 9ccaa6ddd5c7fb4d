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


from bppsa.bench.protocol import StopRule as _StopRule  # noqa: E402

# Checked at parse time, so a bad bench: value stops the run before any job starts.
STOP_RULE = _StopRule.from_config(config["bench"], ignore=["packed_baseline"])


def bench_args():
    """`bppsa bench` flags of the shared timing protocol (config bench:)."""
    packed = config["bench"]["packed_baseline"]
    packed = {True: "on", False: "off"}.get(packed, packed)  # YAML 1.1 reads a bare on/off as a boolean
    return f"{STOP_RULE.cli_args()} --packed-baseline {packed}"


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
