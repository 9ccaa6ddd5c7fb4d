"""The CPU speed benchmark of the RNN backward (issue: foundation, item 11).

On the same weights, batch and Jacobian chain it times
* ``autograd_backward``: ``loss.backward()`` of the baseline nn.RNN;
* ``bppsa_backward``: Jacobian generation + scan + parameter gradients, per layout and ``L_m``;
* the scan alone, three ways: ``scan_blelloch`` (this package), ``scan_linear`` (sequential) and
  ``scan_associative_generic`` (``torch._higher_order_ops.associative_scan``, combine_mode
  "generic", all prefix matrix products, then applied to the gradient vector).
Rows: one per (B, what, repeat) in seconds.
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch

from ..backends import TorchBackend
from ..models.rnn import RNNClassifier
from ..scan import blelloch_scan, linear_scan
from .timing import PhaseTimer


def _time(fn, repeats: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn(None)
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def associative_scan_generic(g: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    from torch._higher_order_ops.associative_scan import associative_scan

    prefixes = associative_scan(lambda a, b: torch.matmul(b, a), J[:-1], dim=0, combine_mode="generic")
    return torch.cat([g.unsqueeze(0), torch.matmul(prefixes, g.unsqueeze(-1)).squeeze(-1)])


def run(seq_len: int, batches: list[int], hidden: int = 20, layouts=("fused", "paper"), L_ms=(None,),
        repeats: int = 10, warmup: int = 2, seed: int = 0, dtype=torch.float32) -> list[dict]:
    rows = []
    backend = TorchBackend()
    for B in batches:
        torch.manual_seed(seed)
        model = RNNClassifier(hidden=hidden).to(dtype)
        rng = np.random.default_rng(seed)
        c = rng.integers(0, 10, B)
        x = torch.from_numpy((rng.random((seq_len, B, 1)) < (0.05 + 0.1 * c)[None, :, None]).astype(np.float32)).to(dtype)
        y = torch.from_numpy(c.astype(np.int64))

        def add(what, secs, **kw):
            rows.extend({"batch": B, "seq_len": seq_len, "hidden": hidden, "what": what, "repeat": i,
                         "seconds": s, **kw} for i, s in enumerate(secs))

        # whole backward passes, phase-timed exactly as in the training benchmark
        def phases(method, layout=None, L_m=None):
            m = copy.deepcopy(model)
            timer = PhaseTimer(torch.device("cpu"))
            secs = []
            for i in range(warmup + repeats):
                m.zero_grad(set_to_none=True)
                if method == "baseline":
                    m.baseline_step(x, y, phase=timer.phase)
                else:
                    m.bppsa_step(x, y, backend, layout, L_m, phase=timer.phase)
                t = timer.collect()
                if i >= warmup:
                    secs.append(t.get("jacobian", 0.0) + t["backward"])
            return secs

        add("autograd_backward", phases("baseline"))
        for layout in layouts:
            for L_m in L_ms:
                add("bppsa_backward", phases("bppsa", layout, L_m), layout=layout, L_m=L_m)

        # the scan alone over the real fused Jacobian chain of this batch
        with torch.no_grad():
            h, _ = model.cell(x)
        h_last = h[-1].detach().requires_grad_(True)
        torch.nn.functional.cross_entropy(model.head(h_last), y).backward()
        g = h_last.grad
        J = backend.rnn_jacobians_t(h.detach(), model.cell.weight_hh_l0.detach(), "fused")
        for L_m in L_ms:
            add("scan_blelloch", _time(lambda _: blelloch_scan(g, J, L_m), repeats, warmup), layout="fused", L_m=L_m)
        add("scan_linear", _time(lambda _: linear_scan(g, J), repeats, warmup), layout="fused")
        add("scan_associative_generic", _time(lambda _: associative_scan_generic(g, J), repeats, warmup), layout="fused")
        ref = linear_scan(g, J)
        for name, out in (("scan_blelloch", blelloch_scan(g, J)), ("scan_associative_generic", associative_scan_generic(g, J))):
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-4:
                raise RuntimeError(f"{name} disagrees with the linear scan (rel err {err:.2e})")
    return rows
