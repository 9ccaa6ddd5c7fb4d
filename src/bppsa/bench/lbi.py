"""LBI's measurements: quality against the dense baseline, bytes per backward, and the backward's time across ranks.

* :func:`train_run`: one model (``dense`` or ``lbi`` at rank ``r``) trained on the byte-level corpus of
  :mod:`bppsa.data.text` (AdamW, linear warm-up then cosine decay, gradient clipping at 1), one thread; its
  validation cross-entropy every ``eval_every`` steps and at the end, also the *prefix* cross-entropy (each
  position scored from its past alone, :func:`bppsa.models.lbi.prefix_cross_entropy`).
  ``backward="scan"`` trains with the scan backward (:func:`bppsa.models.lbi_scan.scan_backward`), which gives
  autograd's gradients (tests/test_lbi.py); ``autograd`` is the same arithmetic, cheaper on one core.
* :func:`rank_rows`: on real ranks (:mod:`bppsa.models.lbi_dist`), the logical bytes each rank sends per step
  (beside the formula's value at the paper's configuration) and the backward's wall time, scan against pipeline.
"""
from __future__ import annotations

import math
import time

import torch

from ..data import text
from ..distributed.launch import run_local
from ..models.lbi import LBILM, DenseLM, lm_loss, prefix_cross_entropy
from ..models.lbi_dist import MODES, expected_bytes, rank_worker
from ..models.lbi_scan import scan_backward

__all__ = ["KINDS", "PAPER", "rank_rows", "train_run"]

KINDS = ("dense", "lbi")
# the configuration whose payload LBI.md matches to the paper's "about 56 KB": K = 8 regions (7 Jacobians),
# r = 64, one sequence per batch, 2-byte (bf16) Jacobians
PAPER = {"regions": 8, "batch": 1, "r": 64, "itemsize": 2, "reported_kb": 56}


def build(kind: str, r: int | None, regions: int, d: int, heads: int, seq: int):
    if kind == "dense":
        return DenseLM(text.VOCAB, d, heads, regions, seq)
    if kind == "lbi":
        return LBILM(text.VOCAB, d, heads, regions, r, seq)
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.no_grad()
def _val(model, vx, vy) -> float:
    return float(lm_loss(model(vx), vy))


def train_run(kind: str, r: int | None, *, regions: int, d: int, heads: int, seq: int, batch: int, steps: int,
              lr: float, seed: int, eval_every: int, val_count: int, val_fraction: float = 0.1,
              backward: str = "autograd", device: str = "cpu") -> tuple[list[dict], dict]:
    """Train one model on ``device``; returns (curve rows, the final row).  The same ``seed`` gives every model the
    same batches (drawn on the CPU)."""
    if backward not in ("autograd", "scan"):
        raise ValueError(f"backward must be autograd or scan, got {backward!r}")
    if backward == "scan" and kind != "lbi":
        raise ValueError("backward 'scan' needs kind 'lbi' (the dense baseline has no interface)")
    data, info = text.corpus()
    train, val = text.split(data, val_fraction)
    vx, vy = (t.to(device) for t in text.val_windows(val, seq, val_count))
    torch.manual_seed(seed)
    model = build(kind, r, regions, d, heads, seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    label = "dense" if kind == "dense" else f"lbi r={r}"
    base = {"kind": kind, "r": r if kind == "lbi" else None, "label": label, "regions": regions, "d": d,
            "heads": heads, "seq": seq, "batch": batch, "steps": steps, "lr": lr, "seed": seed, "backward": backward,
            "device": str(device),
            "params": sum(p.numel() for p in model.parameters()),
            "block_params": sum(p.numel() for n, p in model.named_parameters() if ".blocks." in n or
                                n.startswith("blocks.")),
            **{f"corpus_{k}": v for k, v in info.items()}}
    curve = []
    t0 = time.perf_counter()
    for s in range(steps):
        x, y = (t.to(device) for t in text.train_batch(train, seq, batch, gen))
        for group in opt.param_groups:
            group["lr"] = _lr(s, steps, lr, warmup)
        opt.zero_grad(set_to_none=True)
        if backward == "scan":
            loss = scan_backward(model, x, y).loss
        else:
            loss = lm_loss(model(x), y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            curve.append({**base, "step": s + 1, "train_ce": float(loss.detach()), "val_ce": _val(model, vx, vy)})
    model.eval()
    final = {**base, "val_ce": _val(model, vx, vy), "val_prefix_ce": prefix_cross_entropy(model, vx, vy),
             "val_windows": val_count, "val_tokens": vy.numel(), "train_seconds": time.perf_counter() - t0}
    return curve, final


def _sizes(regions: int, r: int, d: int, heads: int, seq: int) -> dict:
    return {"vocab": text.VOCAB, "d": d, "heads": heads, "regions": regions, "r": r, "max_len": seq}


def rank_rows(ranks: list[int], r: int, *, batch: int, seq: int, d: int, heads: int, repeats: int,
              warmup: int = 1, dtype=torch.float32, seed: int = 0, threads: int = 1) -> tuple[list[dict], list[dict]]:
    """On ``p`` real ranks (one region each, ``threads`` threads each) for each ``p`` of ``ranks``: ``warmup`` untimed
    then ``repeats`` timed rounds of one step by scan and one by pipeline.  Returns (traffic rows, time rows).

    Traffic: per rank, mode, phase and kind, the payload bytes it sent in one step, with the formula's value beside
    (:func:`bppsa.models.lbi_dist.expected_bytes`); then the formula at the paper's configuration (:data:`PAPER`).
    Time: every rank's forward and backward wall seconds of every step."""
    traffic, times = [], []
    item = torch.tensor([], dtype=dtype).element_size()
    for p in ranks:
        torch.manual_seed(seed)
        sizes = _sizes(p, r, d, heads, seq)
        model = LBILM(**sizes).to(dtype)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(0, text.VOCAB, (batch, seq), generator=gen)
        y = torch.randint(0, text.VOCAB, (batch, seq), generator=gen)
        outs = run_local(rank_worker, p, (sizes, model.state_dict(), x, y, MODES, "torch", repeats, warmup),
                         timeout=300, threads=threads)
        for mode in MODES:
            want = expected_bytes(p, batch, r, item, mode)
            for k, o in enumerate(outs):
                got = o[mode]["bytes"]
                for phase in ("forward", "backward"):
                    for what in ("interface", "embedding"):
                        ops = {op: v for (ph, w, op), v in got.items() if ph == phase and w == what}
                        traffic.append({"source": "measured", "mode": mode, "ranks": p, "rank": k, "regions": p,
                                        "batch": batch, "r": r, "itemsize": item, "phase": phase, "what": what,
                                        "bytes": sum(ops.values()), "ops": "+".join(sorted(ops)) or "none",
                                        "formula_bytes": want[phase][k] if what == "interface" else None})
                for i, t in enumerate(o[mode]["times"]):
                    times.append({"mode": mode, "ranks": p, "rank": k, "r": r, "batch": batch, "seq": seq, "d": d,
                                  "iteration": i, "forward_s": t["forward"], "backward_s": t["backward"]})
    P = PAPER
    for mode in MODES:
        want = expected_bytes(P["regions"], P["batch"], P["r"], P["itemsize"], mode)
        for k in range(P["regions"]):
            traffic.append({"source": "paper-config", "mode": mode, "ranks": P["regions"], "rank": k,
                            "regions": P["regions"], "batch": P["batch"], "r": P["r"], "itemsize": P["itemsize"],
                            "phase": "backward", "what": "interface", "bytes": want["backward"][k],
                            "ops": "formula", "formula_bytes": want["backward"][k]})
    return traffic, times
