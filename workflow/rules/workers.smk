# BPPSA with the RNN's sequence split over p processes (gloo, one thread each) against the pipeline on the
# same split: backward time per rank in paired rounds and peak memory per rank (docs/distributed.md), drawn by
# workers_plot in figures.smk. Locally the command spawns its processes; in a SLURM job (profiles/slurm) it runs
# as `srun` tasks, one rank each: `tasks` becomes sbatch's --ntasks, and `mpi` tells the SLURM executor that the
# command launches its own tasks (it does not wrap it in `srun -n1`).


rule workers_bench:
    output:
        time=f"{RESULTS}/workers/time.csv",
        memory=f"{RESULTS}/workers/memory.csv",
        summary=f"{RESULTS}/workers/summary.csv",
    log:
        "logs/workers_bench.log",
    threads: max(WORKERS["ps"] or [1])
    resources:
        **job_resources("cpu_timing"),
        **({"mpi": "srun"} if max(WORKERS["ps"] or [1]) > 1 else {}),
        tasks=max(WORKERS["ps"] or [1]),
        cpus_per_task=1,
    params:
        launch=lambda wc, resources: (
            '$([ -n "${SLURM_JOB_ID:-}" ] && echo srun --ntasks=%d --cpus-per-task=1) '
            % resources.tasks
        ),
        ps=WORKERS["ps"],
        seq_len=WORKERS["seq_len"],
        batch=WORKERS["batch"],
        hidden=RNN["hidden"],
        rounds=WORKERS["rounds"],
        threads=WORKERS["threads"],
        loss=WORKERS["loss"],
        dtype=config["dtype"],
        profile=PROFILE,
        out=lambda wc, output: os.path.dirname(output.time),
    shell:
        "{params.launch}bppsa workers --ps {params.ps} --seq-len {params.seq_len} --batch {params.batch} "
        "--hidden {params.hidden} --rounds {params.rounds} --threads {params.threads} --loss {params.loss} "
        "--dtype {params.dtype} --profile {params.profile} --out {params.out} 2> {log}"
