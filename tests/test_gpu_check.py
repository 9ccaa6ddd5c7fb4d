"""scripts/gpu_check.sh, the time-boxed GPU check: every step is listed with its outcome, and what no longer fits
before the deadline is skipped rather than started (its GPU steps themselves run only on a GPU machine)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["machine", "environment", "doctor", "data", "sanitizer", "gpu_tests", "bench_rnn_T1000_B16",
         "bench_gru_l_B16", "bench_rnn_T30000_B16", "bench_rnn_T1000_B256", "speedups_rnn", "gpu_measured",
         "graphed_rnn_T1000_B16", "graphed_gru_l_B16", "graphed_rnn_T30000_B16", "graphed_rnn_T1000_B256",
         "graphed_rnn_T1000_B16_packed", "speedups_graphed", "jax_rival", "bench_rnn_T100_B16", "bench_gru_s_B64",
         "speedups", "membound_T1000_fused", "membound_T1000_paper", "membound_T10000_fused",
         "membound_T10000_paper"]


def test_steps_past_the_deadline_are_skipped_and_listed(tmp_path):
    env = {**os.environ, "DEADLINE": "0", "DEVICE": "cpu", "DATA": str(tmp_path / "data"), "SANITIZER": "skip",
           "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "res")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t") for line in (tmp_path / "res" / "check" / "steps.tsv").read_text().splitlines()[1:]]
    assert [name for name, *_ in rows] == STEPS
    outcome = dict((name, rc) for name, rc, _ in rows)
    assert outcome.pop("sanitizer") == "skipped" and outcome.pop("gpu_measured").startswith("no cost-model entry")
    assert set(outcome.values()) == {"skipped"}  # nothing was started: no step had time left
    assert "device cpu" in r.stdout
