# The GPU cost model (bppsa gpu-model): bytes, FLOP, launches and a predicted time of the faithful and the
# factored GPU backward over the paper's grid, for every GPU of its table.  Counted from the launch plan,
# no GPU needed; scripts/gpu_reference.sh measures the same layouts on a real one.


localrules:
    gpu_model,


rule gpu_model:
    output:
        rnn_seq_lens="results/gpu_model/rnn_seq_lens.csv",
        rnn_batches="results/gpu_model/rnn_batches.csv",
        gru_sets="results/gpu_model/gru_sets.csv",
    log:
        "logs/gpu_model.log",
    params:
        seq_lens=",".join(str(T) for T in RNN["seq_lens"]),
        batch_at_seq_len=RNN["batch_at_seq_len"],
        seq_len_at_batch=RNN["seq_len_at_batch"],
        batches=",".join(str(B) for B in RNN["batches"]),
        rnn_hidden=RNN["hidden"],
        rnn_input=SPECS["rnn"].input_size,
        gru_sets=",".join(
            f"{MFCC_SETS[s].frames}:{MFCC_SETS[s].features}" for s in GRU["sets"]
        ),
        gru_batches=",".join(str(B) for B in GRU["batches"]),
        gru_hidden=GRU["hidden"],
        dtype=config["dtype"],
    shell:
        "(bppsa gpu-model --cell rnn --seq-len {params.seq_lens} --batch {params.batch_at_seq_len} "
        "--hidden {params.rnn_hidden} --input-size {params.rnn_input} --dtype {params.dtype} --gpu all "
        "--out {output.rnn_seq_lens} && "
        "bppsa gpu-model --cell rnn --seq-len {params.seq_len_at_batch} --batch {params.batches} "
        "--hidden {params.rnn_hidden} --input-size {params.rnn_input} --dtype {params.dtype} --gpu all "
        "--out {output.rnn_batches} && "
        "bppsa gpu-model --cell gru --seq-len {params.gru_sets} --batch {params.gru_batches} "
        "--hidden {params.gru_hidden} --dtype {params.dtype} --gpu all --out {output.gru_sets}) > {log} 2>&1"
