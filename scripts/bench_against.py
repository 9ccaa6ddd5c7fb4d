"""This checkout's bppsa.nn layers against another commit's, paired in one process: a change's cost or gain.

The other commit's package is unpacked (git archive) into a temporary folder as ``bppsa_ref``, its custom ops renamed
(``bppsa_ref::``) so that both register side by side; its CPU kernels build into the same cache, keyed by their own
source.  Per layer (``rnn``, ``gru``) and loss (``hn``: on h_n alone, the paper's single seed; ``steps``: on every
step), the two layers on the same weights and batch run forward and backward round by round (bppsa.bench.protocol);
the CSV has one row per method, round and phase, and the summary the paired ratios ref / this with 95 % intervals.

    python scripts/bench_against.py --ref 6696111 --layer rnn gru --seq-len 1000 --batch 16 --threads 2 --out a.csv
"""
from __future__ import annotations

import argparse
import io as _io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# isort: off
import bppsa.nn  # before torch: its OpenMP settings (bppsa.process)
import pandas as pd
import torch
# isort: on

from bppsa import io
from bppsa.bench.protocol import StopRule, interleave
from bppsa.stats import median_ci, ratio_ci

ROOT = Path(__file__).resolve().parents[1]


def unpack(ref: str, into: Path) -> None:
    """The package of commit ``ref`` as ``into/bppsa_ref``, its ops' namespace renamed."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/bppsa"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=_io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "bppsa").rename(into / "bppsa_ref")
    for f in (into / "bppsa_ref").rglob("*.py"):
        text = f.read_text()
        if "bppsa::" in text or "ops.bppsa." in text:
            f.write_text(text.replace("bppsa::", "bppsa_ref::").replace("torch.ops.bppsa.", "torch.ops.bppsa_ref."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="the commit to compare with")
    ap.add_argument("--layer", nargs="+", choices=("rnn", "gru"), default=["rnn", "gru"])
    ap.add_argument("--loss", nargs="+", choices=("hn", "steps"), default=["hn", "steps"])
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=30.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    tmp = Path(tempfile.mkdtemp(prefix="bppsa_ref_"))
    unpack(a.ref, tmp)
    sys.path.insert(0, str(tmp))
    import bppsa_ref.nn as ref_nn

    rows = []
    for layer in a.layer:
        name = layer.upper()
        torch.manual_seed(0)
        new = getattr(bppsa.nn, name)(1, a.hidden, backend="cpu")
        old = getattr(ref_nn, name)(1, a.hidden, backend="cpu")
        old.load_state_dict(new.state_dict())
        gen = torch.Generator().manual_seed(1)
        x = (torch.rand(a.seq_len, a.batch, 1, generator=gen) < 0.3).float()
        w = torch.randn(a.seq_len, a.batch, a.hidden, generator=gen)
        for loss in a.loss:
            def method(mod, loss=loss, x=x, w=w):
                def run(i: int) -> dict:
                    for p in mod.parameters():
                        p.grad = None
                    t0 = time.perf_counter()
                    out, h_n = mod(x)
                    obj = (out * w).sum() if loss == "steps" else (h_n[-1] * w[-1]).sum()
                    t1 = time.perf_counter()
                    obj.backward()
                    return {"forward": t1 - t0, "backward": time.perf_counter() - t1}
                return run

            m = interleave({"this": method(new), "ref": method(old)}, StopRule(max_seconds=a.max_seconds),
                           reference="ref", metric="backward")
            rows += [{**r, "layer": layer, "loss": loss, "ref": a.ref} for r in m.rows]
    df = pd.DataFrame(rows).assign(seq_len=a.seq_len, batch=a.batch, hidden=a.hidden, threads=a.threads)
    io.write_csv(a.out, df)
    for (layer, loss, phase), d in df.groupby(["layer", "loss", "phase"]):
        per = {k: g.sort_values("iter")["seconds"].to_numpy() for k, g in d.groupby("method")}
        r, lo, hi = ratio_ci(per["ref"], per["this"])
        med = {k: median_ci(v)[0] * 1e3 for k, v in per.items()}
        print(f"{layer} {loss:5s} {phase:8s} ref {med['ref']:8.3f} ms  this {med['this']:8.3f} ms  "
              f"ref/this {r:.3f} [{lo:.3f}, {hi:.3f}]  n={len(per['this'])}")


if __name__ == "__main__":
    main()
