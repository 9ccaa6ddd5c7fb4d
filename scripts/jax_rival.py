#!/usr/bin/env python3
"""The rival a user would pick on a GPU: JAX's compiled BPTT backward of the harness's RNN, timed.

The same Elman tanh RNN as ``bppsa.models.rnn`` (input 1, hidden 20, 10 classes, a linear head on the last hidden
state, mean cross-entropy), with the same weights (``torch.manual_seed(seed)`` then ``bppsa.models.build``, as
``bppsa bench`` makes them) and the same batch (the first B samples of ``DATA_DIR/T{T}.npz``, or the bitstream
generated on the spot with the same seed), written as a ``lax.scan`` over time.  Per shape: the jitted forward
(the loss) and the jitted ``jax.grad`` of the loss with respect to every parameter, fp32, each timed as the median
of calls that end in ``block_until_ready``; the backward is their difference, as the paper's "nobp" subtraction
does.  Before timing, the gradients are checked against torch's autograd on the CPU (fp32, relative error
<= 1e-4, the harness's tolerance) at shapes up to ``--check-up-to`` steps.

JAX is not a dependency of the package: where it is not installed this script says so and exits 0 (the GPU check
goes on).  It runs on whatever device JAX has (``--platform`` to choose); the CSV records it.

Usage: python scripts/jax_rival.py --out results/<device>/jax_rival.csv [--seq-len 1000 30000] [--batch 16]
       [--data-dir DIR] [--min-iters 5] [--max-seconds 10] [--platform gpu|cpu]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

FIELDS = ["model", "seq_len", "batch", "hidden", "input_size", "dtype", "platform", "device", "jax", "forward_s",
          "grad_s", "backward_s", "forward_iters", "grad_iters", "compile_s", "max_rel_err", "data"]


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="CSV to write (one row per shape)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[1000, 30000])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="folder with T{T}.npz bitstreams (else generated here)")
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--max-seconds", type=float, default=10.0, help="per shape and side, after warm-up")
    p.add_argument("--check-up-to", type=int, default=1000, help="check gradients against autograd up to this T")
    p.add_argument("--platform", default=None, help="JAX platform (gpu, cuda, cpu); default: JAX's default")
    return p.parse_args(argv)


def _batch(T: int, B: int, seed: int, data_dir: str | None):
    """x [T, B, 1] float32 and labels [B] (numpy), as ``bppsa bench`` feeds its first batch."""
    import numpy as np
    import torch

    from bppsa.data import bitstream
    from bppsa.data.sequences import open_dataset

    path = Path(data_dir) / f"T{T}.npz" if data_dir else None
    if path is not None and path.is_file():
        ds = open_dataset(path, torch.float32, "cpu")
        x, y = ds.get_batch(np.arange(B))
        return x.numpy(), y.numpy().astype(np.int64), str(path)
    x_bits, y = bitstream.generate(T, B, seed, progress=False)
    x, y = bitstream.batch(x_bits, y, T, np.arange(B), torch.float32, "cpu")
    return x.numpy(), y.numpy().astype(np.int64), f"generated (seed {seed})"


def _torch_model(H: int, seed: int):
    import torch

    from bppsa.models import build

    torch.manual_seed(seed)
    return build("rnn", 1, H, 10).float()


def _params(model) -> dict:
    return {name: p.detach().cpu().numpy().copy() for name, p in model.named_parameters()}


def _loss_fn(jax, jnp):
    def loss(p, x, y):
        def step(h, x_t):
            h = jnp.tanh(x_t @ p["cell.weight_ih_l0"].T + p["cell.bias_ih_l0"] + h @ p["cell.weight_hh_l0"].T
                         + p["cell.bias_hh_l0"])
            return h, None

        h0 = jnp.zeros((x.shape[1], p["cell.weight_hh_l0"].shape[0]), x.dtype)
        h, _ = jax.lax.scan(step, h0, x)
        logits = h @ p["head.weight"].T + p["head.bias"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    return loss


def _median_time(fn, min_iters: int, max_iters: int, max_seconds: float) -> tuple[float, int]:
    times, start = [], time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < max_seconds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), len(times)


def _autograd_grads(model, x, y) -> dict:
    import torch

    model.zero_grad()
    logits = model(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).backward()
    return {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def main(argv=None) -> int:
    args = _args(argv)
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        print(f"jax_rival: JAX is not installed ({exc}); nothing timed. On a GPU: pip install 'jax[cuda13]'.")
        return 0
    import numpy as np

    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    # fp32 products in fp32, as BPPSA's and cuDNN's: on a GPU JAX's default is TF32 (an H200 run: 4.5e-4 off)
    jax.config.update("jax_default_matmul_precision", "highest")
    device = jax.devices()[0]
    print(f"jax_rival: jax {jax.__version__} on {device.platform} ({device.device_kind})")
    loss = _loss_fn(jax, jnp)
    fwd = jax.jit(loss)
    grad = jax.jit(jax.grad(loss))
    rows = []
    for T in args.seq_len:
        model = _torch_model(args.hidden, args.seed)
        x, y, source = _batch(T, args.batch, args.seed, args.data_dir)
        params = jax.device_put({k: jnp.asarray(v) for k, v in _params(model).items()}, device)
        xj, yj = jax.device_put(jnp.asarray(x), device), jax.device_put(jnp.asarray(y, dtype=jnp.int32), device)
        t = time.perf_counter()
        g = jax.block_until_ready(grad(params, xj, yj))
        jax.block_until_ready(fwd(params, xj, yj))
        compile_s = time.perf_counter() - t
        err = float("nan")
        if T <= args.check_up_to:
            ref = _autograd_grads(model, x, y)
            err = max(float(np.abs(np.asarray(g[k]) - r).max() / max(np.abs(r).max(), 1e-30)) for k, r in ref.items())
            if not err <= 1e-4:
                print(f"jax_rival: T={T}: JAX's gradient differs from autograd's by {err:.2e} (> 1e-4)",
                      file=sys.stderr)
                return 1
        limits = (args.min_iters, args.max_iters, args.max_seconds)
        f_s, f_n = _median_time(lambda a=(params, xj, yj): jax.block_until_ready(fwd(*a)), *limits)
        g_s, g_n = _median_time(lambda a=(params, xj, yj): jax.block_until_ready(grad(*a)), *limits)
        row = {"model": "rnn", "seq_len": T, "batch": args.batch, "hidden": args.hidden, "input_size": 1,
               "dtype": "float32", "platform": device.platform, "device": device.device_kind, "jax": jax.__version__,
               "forward_s": f_s, "grad_s": g_s, "backward_s": g_s - f_s, "forward_iters": f_n, "grad_iters": g_n,
               "compile_s": compile_s, "max_rel_err": err, "data": source}
        rows.append(row)
        print(f"jax_rival: T={T} B={args.batch}: forward {f_s * 1e3:.3f} ms, grad {g_s * 1e3:.3f} ms, backward "
              f"{(g_s - f_s) * 1e3:.3f} ms (n = {f_n}, {g_n}; max rel err vs autograd {err:.1e})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
