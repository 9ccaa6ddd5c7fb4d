# Fig 6 (Sec 3.5): LeNet-5 trained through autograd and through bppsa.nn.Sequential (the BPPSA scan over the
# layers' sparse transposed Jacobians), on the CIFAR-10 the workflow prepares (cifar10.source), from the same seed
# and batches; once in the workflow's dtype and once per lenet5.also_dtypes (the float64 twin). And the pruned
# VGG-11 of vgg11_train retrained through the scan (vgg11_scan; iterations 0 skips it): a timing.


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


rule vgg11_retrain_scan:
    input:
        models=f"{VGG_DIR}/models.pt",
        data=CIFAR_MANIFEST,
    output:
        iterations=f"{VGG_DIR}/retrain_scan.csv",
        steps=f"{VGG_DIR}/retrain_scan_steps.csv",
    log:
        "logs/vgg11_retrain_scan.log",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        iterations=VGG_SCAN["iterations"],
        batch_size=VGG_SCAN["batch_size"],
        lr=VGG["lr"],
        L_m=L_m_arg(VGG_SCAN["L_m"]),
        profile_iterations=VGG_SCAN["profile_iterations"],
    shell:
        "bppsa vgg11-retrain-scan --models {input.models:q} --data {input.data:q} "
        "--iterations {params.iterations} --batch-size {params.batch_size} --lr {params.lr} "
        "--L-m {params.L_m} --profile-iterations {params.profile_iterations} --threads {threads} "
        "{params.args} --out {output.iterations} --out-steps {output.steps} > {log} 2>&1"


# the bench-cnn cases (cnn_bench): autograd vs BPPSA training steps, interleaved, on this device
rule cnn_bench:
    input:
        unpack(get_cnn_bench_input),
    output:
        f"{RESULTS}/cnn/bench_{{net}}_B{{B}}.csv",
    log:
        "logs/cnn_bench/{net}_B{B}.log",
    wildcard_constraints:
        net="lenet5|vgg11",
    threads: job_threads("timing")
    resources:
        **job_resources("timing"),
    params:
        args=runtime_args(),
        protocol=protocol_args(),
        net_args=get_cnn_bench_args,
    shell:
        "bppsa bench-cnn --model {wildcards.net} --batch {wildcards.B} --data {input.data:q} "
        "{params.net_args} {params.protocol} --threads {threads} {params.args} --out {output} > {log} 2>&1"
