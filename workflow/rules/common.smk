# Helpers shared by the rule files.


def runtime_args():
    """The CLI flags every measuring command gets: device, dtype, profile and seed."""
    slug = f" --device-slug {config['device_slug']}" if config.get("device_slug") else ""
    return f"--device {config['device']} --dtype {config['dtype']} --profile {PROFILE} --seed {config['seed']}{slug}"


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
    shell:
        "bppsa device --device {config[device]} --json > {output}.tmp && mv {output}.tmp {output}"


TARGETS.append(f"results/{DEVICE}/environment.json")
