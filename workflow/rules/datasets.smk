# Bitstream datasets of Sec 4.1 (Eq. 8): one file per sequence length.


rule make_bitstream:
    output:
        "data/bitstream/T{T}.npz",
    wildcard_constraints:
        T=r"\d+",
    params:
        samples=config["bitstream"]["samples"],
        seed=config["bitstream"]["seed"],
    log:
        "logs/make_bitstream/T{T}.log",
    shell:
        "bppsa make-bitstream --seq-len {wildcards.T} --samples {params.samples} --seed {params.seed} "
        "--out {output} 2> {log}"
