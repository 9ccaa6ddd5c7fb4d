"""`bppsa jacobians-table1`: the measurements of Table 1 of the paper (its text: `bppsa plot table1`)."""
from __future__ import annotations

import platform
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from .. import io
from ..bench.protocol import StopRule, interleave
from ..bench.timing import timed
from .argtypes import positive_int
from .common import add_runtime_args, setup

# VGG-11's first conv, ReLU and max-pool on a 32x32 image (the paper's Table 1 examples)
C_IN, C_OUT, SIZE, KERNEL, PADDING, POOL = 3, 64, 32, 3, 1, 2


def register(sub) -> None:
    p = sub.add_parser("jacobians-table1",
                       help="Table 1: guaranteed-zero sparsity and analytic-vs-autograd generation time (CSV)")
    p.add_argument("--repeats-analytic", type=positive_int, default=20,
                   help="timed analytic generations per operator, at least (the paper: 1000); more, up to 10x, "
                        "until the median is known to +-5 %%")
    p.add_argument("--repeats-autograd", type=int, default=1,
                   help="timed column-by-column autograd generations per operator (the paper: 1000; "
                   "0 skips autograd: sparsity only, no speedup, as the toy .test configuration does)")
    p.add_argument("--mkldnn", action="store_true",
                   help="let autograd use oneDNN for the conv (off by default: on CPU its per-call overhead makes "
                        "single-column backward passes ~30x slower, which would flatter the analytic routine)")
    p.add_argument("--data-label", default="random input (sparsity and timing do not depend on it)")
    p.add_argument("--out", required=True, help="CSV of raw timings, one row per operator x method x repeat")
    add_runtime_args(p)
    p.set_defaults(func=_measure)


class Operator(NamedTuple):
    name: str  # as in the paper's Table 1
    op: str  # bppsa.jacobians.sparse.sparsity_expression's name for it
    analytic: Callable  # () -> the analytic CSR transposed Jacobian
    function: Callable  # the operator itself, for autograd's column-by-column Jacobian
    input: torch.Tensor
    shape: dict  # sizes for the sparsity expression


def _operators(seed: int) -> list[Operator]:
    """VGG-11's first conv, ReLU and max-pool, in the paper's order."""
    from ..jacobians import sparse as sparse_jacobians  # scipy.sparse: imported by the jobs that use it

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(C_OUT, C_IN, KERNEL, KERNEL, generator=g) * (2.0 / (C_IN * KERNEL * KERNEL)) ** 0.5
    x = torch.randn(C_IN, SIZE, SIZE, generator=g)
    conv_out = torch.nn.functional.conv2d(x[None], w, padding=PADDING)[0]
    relu_out = torch.relu(conv_out)
    _, pool_idx = torch.nn.functional.max_pool2d(relu_out[None], POOL, stride=POOL, return_indices=True)
    conv_np = conv_out.numpy()
    return [
        Operator("Convolution", "conv2d",
         lambda: sparse_jacobians.conv2d_jacobian_t(w, (C_IN, SIZE, SIZE), PADDING, dtype=np.float32),
         lambda t: torch.nn.functional.conv2d(t[None], w, padding=PADDING)[0], x,
         dict(c=C_IN, h=SIZE, w=SIZE, hf=KERNEL, wf=KERNEL)),
        Operator("ReLU", "relu",
         lambda: sparse_jacobians.relu_jacobian_t(conv_np, dtype=np.float32),
         torch.relu, conv_out,
         dict(c=C_OUT, h=SIZE, w=SIZE)),
        # the forward pass's pool indices are taken as given, as in the paper's Algorithm 8
        Operator("Max-pooling", "maxpool2d",
         lambda: sparse_jacobians.maxpool2d_jacobian_t(relu_out, POOL, indices=pool_idx[0], dtype=np.float32),
         lambda t: torch.nn.functional.max_pool2d(t[None], POOL, stride=POOL)[0], relu_out,
         dict(c=C_OUT, h=SIZE, w=SIZE, hf=POOL, wf=POOL)),
    ]


def _measure(args) -> int:
    from ..jacobians import sparse as sparse_jacobians

    setup(args)
    if args.repeats_analytic < 1 or args.repeats_autograd < 0:
        raise ValueError("--repeats-analytic must be >= 1 and --repeats-autograd >= 0")
    rows = []
    meta = dict(profile=args.profile, device_slug=args.device_slug,
                processor=platform.processor() or platform.machine(),
                threads=torch.get_num_threads(), mkldnn=bool(args.mkldnn), data=args.data_label)
    for name, op, analytic, f, x, expr in _operators(args.seed):
        M = analytic()  # warm-up, and the matrix the autograd result is checked against
        sparsity = sparse_jacobians.guaranteed_sparsity(M)
        common = dict(operator=name, op=op, rows=M.shape[0], cols=M.shape[1], nnz=M.nnz, sparsity=sparsity,
                      sparsity_expression=sparse_jacobians.sparsity_expression(op, **expr),
                      csr_mb=(M.data.nbytes + M.indices.nbytes + M.indptr.nbytes) / 2**20,
                      dense_mb=M.shape[0] * M.shape[1] * 4 / 2**20, **meta)
        # the shared protocol: at least the requested repeats, more (up to 10x, 10 s) until the median is
        # known to +-5 %; the warm-up generation above is not timed
        m = interleave({"analytic": lambda i, analytic=analytic: {"analytic": timed(analytic)[0]}},
                       StopRule(warmup=0, min_iters=args.repeats_analytic, min_seconds=0.0,
                                max_iters=10 * args.repeats_analytic, max_seconds=10.0))
        rows += [dict(common, method="analytic", repeat=r["iter"], seconds=r["seconds"]) for r in m.rows]
        with torch.backends.mkldnn.flags(enabled=args.mkldnn):
            for i in range(args.repeats_autograd):
                secs, A = timed(lambda f=f, x=x: sparse_jacobians.autograd_jacobian_t_columns(f, x))
                rows.append(dict(common, method="autograd-columns", repeat=i, seconds=secs))
                if i == 0:
                    # autograd drops the explicit zeros the analytic CSR keeps, so compare values
                    err = abs(A - M).max() if A.nnz or M.nnz else 0.0
                    if err > 1e-5:
                        raise RuntimeError(f"{name}: analytic and autograd transposed Jacobians differ by {err:.3e}")
        an = np.median([r["seconds"] for r in rows if r["operator"] == name and r["method"] == "analytic"])
        ag = [r["seconds"] for r in rows if r["operator"] == name and r["method"] == "autograd-columns"]
        ag = np.median(ag) if ag else float("nan")
        print(f"{name}: sparsity {sparsity:.5f}; analytic {an * 1e3:.2f} ms, autograd by columns {ag:.2f} s, "
              f"speedup {ag / an:.3g}x",
              flush=True)
    io.write_csv(args.out, pd.DataFrame(rows))
    return 0
