# Helpers shared by the rule files.


def runtime_args():
    """The CLI flags every measuring command gets: device, dtype, profile and seed."""
    slug = f" --device-slug {config['device_slug']}" if config.get("device_slug") else ""
    return f"--device {config['device']} --dtype {config['dtype']} --profile {PROFILE} --seed {config['seed']}{slug}"


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
    shell:
        "bppsa device --device {config[device]} --json > {output}.tmp && mv {output}.tmp {output}"


TARGETS.append(f"results/{DEVICE}/environment.json")
