"""The workflow's job count (``snakemake -n``) and a GPU-time estimate of a profile (``bppsa paper-shapes``).

Each figure is counted from the config or the dry run, cited from PAPER.md (:mod:`bppsa.paper`), or measured
on this machine and then labelled a CPU figure.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ..bench.preflight import cfg_get
from ..paper import PAPER_EPOCH_S, PAPER_SAMPLES


def dry_run(configfile: str | Path, root: str | Path = ".", timeout: float = 600) -> dict:
    """``snakemake -n --forceall --configfile F`` from ``root``: the job stats and, per job, its rule and
    declared ``runtime`` (minutes) and whether it asks for a GPU."""
    cmd = [sys.executable, "-m", "snakemake", "-n", "--forceall", "--configfile", str(Path(configfile).resolve())]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
    text = r.stdout + "\n" + r.stderr
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {text.strip().splitlines()[-1] if text.strip() else r.returncode}")
    return parse_dry_run(text) | {"command": " ".join(["snakemake"] + cmd[3:])}


def parse_dry_run(text: str) -> dict:
    counts: dict[str, int] = {}
    m = re.search(r"Job stats:\n(.*?)\n\s*total\s+(\d+)", text, re.S)
    if not m:
        raise RuntimeError("no 'Job stats' table in the snakemake dry-run output")
    for line in m.group(1).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    jobs = []
    for block in re.split(r"\n(?=(?:localrule|rule) \w+:)", text):
        head = re.match(r"(?:localrule|rule) (\w+):", block)
        if not head:
            continue
        res = re.search(r"resources: (.*)", block)
        fields = dict(kv.split("=", 1) for kv in res.group(1).split(", ") if "=" in kv) if res else {}
        jobs.append(dict(rule=head.group(1), runtime_min=float(fields.get("runtime", "nan")),
                         gpu="gpu" in fields and fields["gpu"] not in ("0", "")))
    return {"counts": counts, "total": int(m.group(2)), "jobs": jobs}


CIFAR10_TRAIN = 50000  # the CIFAR-10 training set


def gpu_time_estimate(cfg: Mapping, counts: Mapping[str, int], vgg_step_ms: float | None,
                      source: str = "config") -> list[dict]:
    """Rows (item, jobs, hours, derivation) of a GPU-time estimate of the profile: each figure is counted from
    the config or the dry run, cited from PAPER.md, or measured (and then labelled a CPU figure)."""
    g = lambda k: cfg_get(cfg, k, source)  # noqa: E731
    rows = []
    cap = float(g("bench.max_seconds"))
    for rule in ("rnn_bench", "gru_bench"):
        n = counts.get(rule, 0)
        rows.append(dict(item=rule, jobs=n, hours=n * cap / 3600,
                         derivation=f"{n} jobs x bench.max_seconds = {cap:g} s of timed rounds each (the cap; a "
                                    f"configuration that stabilises earlier stops sooner; warm-up rounds not counted)"))
    epochs, T, B = int(g("rnn.curves.epochs")), int(g("rnn.curves.seq_len")), int(g("rnn.curves.batch"))
    samples = int(g("bitstream.samples"))
    scale = samples / PAPER_SAMPLES["rnn"]
    acc, acc_src = PAPER_EPOCH_S[("rnn", "forward@256")]
    per = {m: PAPER_EPOCH_S[("rnn", m)] for m in ("baseline", "bppsa")}
    same_shape = (T, B) == (1000, 16)
    for rule, note in (("rnn_train", ""), ("rnn_train_in_dtype", " ASSUMPTION: the fp32 rate (PAPER.md gives no "
                                                                 "float64 times), so fp64 on a GPU is likely longer")):
        n = counts.get(rule, 0)
        if not n:
            continue
        secs = epochs * scale * (per["baseline"][0] + per["bppsa"][0] + 2 * acc) * (n / 2)
        rows.append(dict(item=rule, jobs=n, hours=secs / 3600,
                         derivation=f"{n} jobs (baseline, BPPSA) x rnn.curves.epochs = {epochs} x (V100 s/epoch: "
                                    f"{per['baseline'][0]} [{per['baseline'][1]}], "
                                    f"{per['bppsa'][0]} [{per['bppsa'][1]}]"
                                    f" + the per-epoch accuracy pass at chunk 256, {acc} [{acc_src}] each) x "
                                    f"bitstream.samples / 32,000 = {scale:g}"
                                    + ("" if same_shape else f"; NOTE the curve shape T={T}, B={B} is not Table 4's")
                                    + "." + note))
    epochs_g, Bg = int(g("gru.curves.epochs")), int(g("gru.curves.batch"))
    clips = int(g("irmas.synthetic_clips"))
    scale_g = clips / PAPER_SAMPLES["gru"]
    secs, parts = 0.0, []
    for st in g("gru.curves.sets"):
        b, bp, fw = (PAPER_EPOCH_S[(f"gru-{st}", k)] for k in ("baseline", "bppsa", "forward@64"))
        secs += epochs_g * scale_g * (b[0] + bp[0] + 2 * fw[0])
        parts.append(f"{st.upper()}: {b[0]} + {bp[0]} + 2 x {fw[0]}")
    n = counts.get("gru_train", 0)
    rows.append(dict(item="gru_train", jobs=n, hours=secs / 3600,
                     derivation=f"gru.curves.epochs = {epochs_g} x per set (V100 s/epoch, PAPER.md Table 6, B = 16: "
                                f"baseline + BPPSA + 2 accuracy passes at the B = 64 FP rate, an upper bound for "
                                f"chunk 256): {'; '.join(parts)}; x irmas clips / 6,705 = {scale_g:g}"
                                + ("" if Bg == 16 else f"; NOTE gru.curves.batch = {Bg}, not Table 6's 16")))
    ep, rep, bs = int(g("vgg11.epochs")), int(g("vgg11.retrain_epochs")), int(g("vgg11.batch_size"))
    steps = (ep + rep) * math.ceil(CIFAR10_TRAIN / bs)
    rows.append(dict(item="vgg11_train", jobs=counts.get("vgg11_train", 0), hours=float("nan"),
                     derivation=f"(vgg11.epochs + vgg11.retrain_epochs) x ceil(50,000 / {bs}) = {steps} steps; "
                                "PAPER.md cites no VGG-11 training time, so no GPU hours are given"
                                + (f" (this CPU's measured step, {vgg_step_ms:.0f} ms, would take "
                                   f"{steps * vgg_step_ms / 3.6e6:.1f} h: a CPU figure, not a GPU estimate)"
                                   if vgg_step_ms and math.isfinite(vgg_step_ms) else "")))
    return rows
