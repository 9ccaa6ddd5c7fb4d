# Latent Bounded Interfaces (docs/lbi.md): the LBI language model against its dense baseline (lbi_train, one job
# per model and seed), and one region per rank over gloo (lbi_ranks: bytes per backward, backward time; a timing
# job, alone on its node or machine as every benchmark).
# Figure: `bppsa plot lbi` (rule lbi_plot, figures.smk); claims: claims.md's LBI rows.


wildcard_constraints:
    lbi_model=r"dense|r[0-9]+",
    lbi_seed=r"[0-9]+",


rule lbi_train:
    output:
        f"{RESULTS}/lbi/train_{{lbi_model}}_s{{lbi_seed}}.csv",
    log:
        "logs/lbi_train/{lbi_model}_s{lbi_seed}.log",
    threads: 1
    resources:
        **job_resources("default"),
    params:
        model=lambda wc: (
            "--kind dense"
            if wc.lbi_model == "dense"
            else f"--kind lbi --r {wc.lbi_model[1:]}"
        ),
        lbi=config.get("lbi", {}),
        profile=PROFILE,
    shell:
        "bppsa lbi-train {params.model} --regions {params.lbi[regions]} --d {params.lbi[d]} "
        "--heads {params.lbi[heads]} --seq {params.lbi[seq]} --batch {params.lbi[batch]} "
        "--steps {params.lbi[steps]} --lr {params.lbi[lr]} --eval-every {params.lbi[eval_every]} "
        "--val-windows {params.lbi[val_windows]} --device {params.lbi[device]} --seed {wildcards.lbi_seed} "
        "--threads {threads} --profile {params.profile} --out {output} > {log} 2>&1"


rule lbi_ranks:
    output:
        traffic=f"{RESULTS}/lbi/traffic.csv",
        times=f"{RESULTS}/lbi/backward_time.csv",
    log:
        "logs/lbi_ranks.log",
    threads: max(config.get("lbi", {}).get("ranks") or [1])
    resources:
        **job_resources("cpu_timing"),
    params:
        ranks=" ".join(map(str, config.get("lbi", {}).get("ranks", []))),
        lbi=config.get("lbi", {}),
        profile=PROFILE,
    shell:
        "bppsa lbi-ranks --ranks {params.ranks} --r {params.lbi[ranks_r]} --d {params.lbi[d]} "
        "--heads {params.lbi[heads]} --seq {params.lbi[seq]} --batch {params.lbi[batch]} "
        "--repeats {params.lbi[repeats]} --threads 1 --profile {params.profile} "
        "--traffic-out {output.traffic} --time-out {output.times} > {log} 2>&1"
