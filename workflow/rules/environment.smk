# results/<device>/environment.json: the hardware, software, SLURM allocation and container a run saw.


rule environment_record:
    output:
        f"{RESULTS}/environment.json",
    log:
        "logs/environment_record.log",
    threads: job_threads("verify")
    resources:
        **job_resources("verify"),
    params:
        device=config["device"],
        slug=DEVICE,
        results=lambda wildcards, output: Path(output[0]).parent,
    shell:
        "bppsa device --device {params.device} --device-slug {params.slug} --results-dir {params.results} --json "
        "> {output}.tmp 2> {log} && mv {output}.tmp {output}"
