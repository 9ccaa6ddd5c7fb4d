"""bppsa.bench.layers (scripts/bench_nn.py): every method's rows on one batch, the summary's paired ratios, and
JAX's step held to autograd's gradient before it is timed."""
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from bppsa.bench import layers
from bppsa.bench.protocol import StopRule

RULE = StopRule(warmup=1, min_iters=8, max_iters=8, min_seconds=0.0, max_seconds=30.0)


@pytest.mark.parametrize("layer", ["rnn_relu", "lstm"])
def test_rows_per_method_phase_and_round_and_their_ratios(layer):
    df = layers.run(layer, 37, 3, hidden=6, loss="steps", L_ms=("auto", None, 0), rule=RULE)
    want = {"bppsa", "bppsa-tree", "bppsa-L0", "torch"} | ({"torch-generic"} if layer == "lstm" else set())
    assert set(df.method) == want
    assert (df.groupby(["method", "phase"]).size() == 8).all() and set(df.phase) == set(layers.PHASES)
    assert (df.seconds > 0).all()
    s = layers.summary(df)
    step = s[s.what == "step"].set_index("ratio")
    assert {"torch / bppsa", "torch / bppsa-tree", "torch / bppsa-L0"} <= set(step.index)
    for r in step.itertuples():
        assert r.ci_low <= r.median <= r.ci_high


def test_jax_step_is_checked_then_timed_as_one_phase():
    pytest.importorskip("jax")
    df = layers.run("rnn", 37, 3, hidden=6, loss="hn", rule=RULE, jax=True)
    assert set(df[df.method == "jax"].phase) == {"step"}
    s = layers.summary(df)
    assert "jax" not in set(s[s.what == "backward"].ratio)  # XLA fuses the phases: the step alone compares
    assert "jax / bppsa" in set(s[s.what == "step"].ratio)
    mod = torch.nn.RNN(1, 5)
    with pytest.raises(ValueError, match="one-layer"):
        layers.jax_step(torch.nn.RNN(1, 5, num_layers=2), torch.zeros(4, 2, 1), torch.zeros(4, 2, 5), "hn", 1e-6)
    x, w = torch.randn(9, 2, 1), torch.randn(9, 2, 5)
    layers.jax_step(mod, x, w, "steps", 1e-6)  # the check passes on the same layer
    with pytest.raises(RuntimeError, match="from autograd's"):
        layers.jax_step(mod, x, w, "steps", 1e-6, tol=-1.0)  # and can fail


def test_the_rows_record_the_subnormal_mode():
    try:
        for flag, mode in ((True, "flushed"), (False, "kept")):
            torch.set_flush_denormal(flag)
            assert layers.subnormal_mode() == mode
    finally:
        torch.set_flush_denormal(False)


def test_the_script_keeps_subnormals_on_request(tmp_path):
    """scripts/bench_nn.py flushes subnormals by default, as the commands do; --keep-denormals times in torch's own
    mode, and its rows say so."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_nn.py"
    out = tmp_path / "nn.csv"
    r = subprocess.run([sys.executable, str(script), "--layer", "rnn", "--seq-len", "9", "--batch", "3", "--hidden",
                        "6", "--threads", "1", "--max-seconds", "0.5", "--keep-denormals", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    df = pd.read_csv(out)
    assert set(df.subnormals) == {"kept"} and {"bppsa", "torch"} <= set(df.method)
