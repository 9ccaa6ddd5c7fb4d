"""Exactness check: one batch through the autograd baseline and the BPPSA backward, same weights."""
from __future__ import annotations

import torch

from .backends import get_backend
from .models import build, copy_model, spec
from .precision import DTYPES, TOLERANCE, ieee_fp32


def grad_errors(ref: torch.nn.Module, got: torch.nn.Module) -> dict[str, float]:
    """Per parameter: max|g - g_ref| / max|g_ref| (the absolute error where g_ref is all zero,
    e.g. W_hh when T = 1 and h_0 = 0)."""
    out = {}
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), got.named_parameters()):
        if p.grad is None:
            raise RuntimeError(f"BPPSA produced no gradient for {name}")
        scale = p_ref.grad.abs().max().item()
        out[name] = (p.grad - p_ref.grad).abs().max().item() / (scale if scale > 0 else 1.0)
    return out


def verify(model: str = "rnn", seq_len: int = 17, batch: int = 5, hidden: int | None = None,
           input_size: int | None = None, classes: int | None = None, dtype: str = "float64", backend: str = "torch",
           layout: str = "fused", L_m: int | None = None, seed: int = 0, device: str = "cpu",
           forward: str = "torch") -> dict:
    """One batch's gradients by autograd and by BPPSA from the same weights.  ``forward``: the BPPSA layer's forward
    ("torch", the one every timed comparison of the paper's claims runs; "auto", the compiled one)."""
    s = spec(model)
    input_size, hidden, classes = input_size or s.input_size, hidden or s.hidden, classes or s.classes
    dev = torch.device(device)
    be = get_backend(backend, dev)
    torch.manual_seed(seed)
    ref = build(model, input_size, hidden, classes).to(device=dev, dtype=DTYPES[dtype])
    got = copy_model(ref)
    g = torch.Generator().manual_seed(seed + 1)
    if model == "rnn":  # bitstream-like inputs with a per-sample Bernoulli rate
        p = torch.rand(1, batch, 1, generator=g) * 0.9 + 0.05
        x = torch.bernoulli(p.expand(seq_len, batch, input_size), generator=g)
    else:
        x = torch.randn(seq_len, batch, input_size, generator=g)
    x = x.to(device=dev, dtype=DTYPES[dtype])
    y = torch.randint(0, classes, (batch,), generator=g).to(dev)
    with ieee_fp32():  # TF32 would make the cuDNN/cuBLAS reference itself only ~1e-3 accurate
        loss_ref = ref.baseline_step(x, y)
        loss_got = got.bppsa_step(x, y, be, layout, L_m, forward=forward)
    errs = grad_errors(ref, got)
    max_rel = max(errs.values())
    return {
        "model": model, "seq_len": seq_len, "batch": batch, "hidden": hidden, "input_size": input_size,
        "dtype": dtype, "backend": be.name, "layout": layout, "L_m": L_m, "seed": seed, "device": str(dev),
        "forward": forward,
        "loss_baseline": loss_ref.item(), "loss_bppsa": loss_got.item(),
        "max_rel_err": max_rel, "rel_err": errs, "tolerance": TOLERANCE[dtype], "ok": max_rel <= TOLERANCE[dtype],
    }
