# Fig 6 (Sec 3.5): LeNet-5 trained through autograd and through bppsa.nn.Sequential (the BPPSA scan over the
# layers' sparse transposed Jacobians), on the CIFAR-10 the workflow prepares (cifar10.source), from the same seed
# and batches; once in the workflow's dtype and once per lenet5.also_dtypes (the float64 twin).


rule lenet5_curves:
    input:
        CIFAR_MANIFEST,
    output:
        f"{LENET_DIR}/curve_{{dtype}}.csv",
    log:
        "logs/lenet5_curves/{dtype}.log",
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    params:
        args=get_runtime_args_in_dtype,
        iterations=LENET["iterations"],
        batch_size=LENET["batch_size"],
        lr=LENET["lr"],
        momentum=LENET["momentum"],
        test_every=LENET["test_every"],
        test_samples=LENET["test_samples"],
        L_m=L_m_arg(LENET["L_m"]),
    shell:
        "bppsa lenet5-curves --data {input:q} --iterations {params.iterations} "
        "--batch-size {params.batch_size} --lr {params.lr} --momentum {params.momentum} "
        "--test-every {params.test_every} --test-samples {params.test_samples} --L-m {params.L_m} "
        "--threads {threads} {params.args} --out {output} > {log} 2>&1"
