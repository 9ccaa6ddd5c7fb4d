# The GPU cost model (bppsa gpu-model): bytes, FLOP, launches and a predicted time of the faithful and the
# factored GPU backward over the paper's grid, for every GPU of its table.  Counted from the launch plan,
# no GPU needed; scripts/gpu_reference.sh measures the same layouts on a real one.


localrules:
    gpu_model,


rule gpu_model:
    output:
        GPU_MODEL,
    log:
        "logs/gpu_model.log",
    params:
        cases=gpu_model_cases(),
        rnn_input=SPECS["rnn"].input_size,
        dtype=config["dtype"],
    shell:
        "bppsa gpu-model {params.cases} --input-size {params.rnn_input} --dtype {params.dtype} --gpu all "
        "--out {output} > {log} 2>&1"
