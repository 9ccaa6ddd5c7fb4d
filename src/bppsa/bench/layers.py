"""The layers of :mod:`bppsa.nn` against their torch.nn twins on a CPU: forward, backward and a whole training step
(forward, backward, SGD), methods interleaved round by round on the same weights and batch (:mod:`.protocol`).

Methods, per layer (``rnn``, ``rnn_relu``, ``gru``, ``lstm``; ``num_layers`` of them):

* ``bppsa`` (the layer's default ``L_m="auto"``; ``bppsa-tree`` for the full tree, ``bppsa-L<L_m>`` for each
  heterogeneous scan asked for, ``-sliced``/``-serial`` for the forward split over slices or not): the bppsa.nn
  layer, its backward the scan;
* ``torch``: torch.nn's layer as it comes (on a CPU the LSTM runs oneDNN's fused kernel: the rival a user has);
* ``torch-generic`` (the LSTM): the same with oneDNN off, torch's generic recurrent loop, as torch.nn.RNN and GRU
  always run;
* ``jax`` (``jax=True``; one-layer RNNs on a CPU): the same layer, weights and loss in JAX, ``lax.scan`` over time,
  the loss's ``jax.value_and_grad`` and the SGD update jitted as one XLA program (fp32 matmuls at full precision),
  its gradient checked against autograd's before timing.  Its rows have the one phase ``step`` (XLA fuses the
  three), so only the step is compared with it.

The loss is on h_n alone (``hn``, the paper's single seed) or on every step (``steps``).  One row per method, round
and phase (``forward``, ``backward``, ``sgd``), with the shape, the threads and the subnormal mode
(:func:`subnormal_mode`); :func:`summary` gives each phase's and the whole step's medians and
the paired ratios ``torch* / bppsa*`` with 95 % intervals.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pandas as pd
import torch

from ..stats import median_ci, ratio_ci
from .protocol import StopRule, interleave

LAYERS = {"rnn": ("RNN", {}), "rnn_relu": ("RNN", {"nonlinearity": "relu"}), "gru": ("GRU", {}),
          "lstm": ("LSTM", {})}
FUSED_ON_CPU = ("lstm",)  # torch.nn runs oneDNN's fused kernel for these on a CPU, not the generic loop
PHASES = ("forward", "backward", "sgd")


def _finals(h_n) -> torch.Tensor:
    return h_n[0] if isinstance(h_n, tuple) else h_n


def methods_for(layer: str, input_size: int, hidden: int, num_layers: int, L_ms=("auto",), backend: str = "auto",
                forwards=(None,), device="cpu"):
    """name -> module, on one set of weights: the bppsa.nn layer per L_m (``auto``, the default, unnamed; None the
    full tree, ``-tree``; an int ``-L<int>``) and per ``parallel_forward`` in ``forwards`` (``-sliced`` True,
    ``-serial`` False; None, the default, unnamed), torch.nn's, and (oneDNN's layers
    on a CPU) its generic loop."""
    import bppsa.nn as bnn

    name, kw = LAYERS[layer]
    torch.manual_seed(0)
    ours = getattr(bnn, name)(input_size, hidden, num_layers, backend=backend, **kw)
    out = {}
    for L_m in L_ms:
        for pf in forwards:
            m = getattr(bnn, name)(input_size, hidden, num_layers, backend=backend, L_m=L_m, parallel_forward=pf,
                                   **kw)
            m.load_state_dict(ours.state_dict())
            tag = {"auto": "", None: "-tree"}.get(L_m, f"-L{L_m}") + {None: "", True: "-sliced", False: "-serial"}[pf]
            out[f"bppsa{tag}"] = (m.to(device), contextlib.nullcontext)
    out["torch"] = (ours.to_torch().to(device), contextlib.nullcontext)
    if layer in FUSED_ON_CPU and torch.device(device).type == "cpu":
        out["torch-generic"] = (ours.to_torch(), lambda: torch.backends.mkldnn.flags(enabled=False))
    return out


def jax_step(mod, x: torch.Tensor, w: torch.Tensor, loss: str, lr: float, tol: float = 1e-4):
    """The ``jax`` method's step for the one-layer RNN ``mod`` (a bppsa.nn or torch.nn RNN): a callable ``step(i)``
    that runs one jitted training step (value, gradient, SGD) and returns ``{"step": seconds}``.  Raises
    ImportError without JAX, ValueError for a layer it does not write, and RuntimeError where JAX's gradient is
    more than ``tol`` (relative) from autograd's on the same weights, batch and loss."""
    import jax
    import jax.numpy as jnp

    if mod.mode not in ("RNN_TANH", "RNN_RELU") or mod.num_layers != 1 or mod.bidirectional or not mod.bias:
        raise ValueError(f"jax_step writes the one-layer, one-direction RNN with biases, not {mod}")
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 products, as torch's on a CPU
    act = jnp.tanh if mod.mode == "RNN_TANH" else jax.nn.relu
    names = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
    p = {k: jnp.asarray(getattr(mod, k).detach().cpu().numpy()) for k in names}
    X, W = jnp.asarray(x.cpu().numpy()), jnp.asarray(w.cpu().numpy())

    def objective(p):
        a = X @ p["weight_ih_l0"].T + p["bias_ih_l0"] + p["bias_hh_l0"]

        def cell(h, a_t):
            h = act(a_t + h @ p["weight_hh_l0"].T)
            return h, h

        h_n, hs = jax.lax.scan(cell, jnp.zeros((X.shape[1], W.shape[2]), X.dtype), a)
        return (hs * W).sum() if loss == "steps" else (h_n * W[-1]).sum()

    @jax.jit
    def train(p):
        v, g = jax.value_and_grad(objective)(p)
        return v, g, jax.tree_util.tree_map(lambda q, d: q - lr * d, p, g)

    _, g, _ = train(p)  # compiles; the gradient against autograd's on the same weights
    ref = torch.nn.RNN(mod.input_size, mod.hidden_size, nonlinearity=mod.nonlinearity)
    ref.load_state_dict({k: getattr(mod, k).detach().cpu() for k in names})
    out, h_n = ref(x.cpu())
    ((out * w.cpu()).sum() if loss == "steps" else (h_n[-1] * w[-1].cpu()).sum()).backward()
    for k in names:
        want = getattr(ref, k).grad
        err = float((torch.from_numpy(np.asarray(g[k])) - want).norm() / want.norm())
        if not err <= tol:
            raise RuntimeError(f"jax_step: JAX's gradient of {k} is {err:.2e} from autograd's (> {tol})")
    state = {"p": p}

    def step(i: int) -> dict:
        t0 = time.perf_counter()
        _, _, state["p"] = train(state["p"])
        jax.block_until_ready(state["p"])
        return {"step": time.perf_counter() - t0}

    return step


def run(layer: str, seq_len: int, batch: int, hidden: int = 20, input_size: int = 1, num_layers: int = 1,
        loss: str = "hn", L_ms=("auto",), rule: StopRule | None = None, seed: int = 0, forwards=(None,),
        device="cpu", jax: bool = False) -> pd.DataFrame:
    """Interleaved rounds of every method of :func:`methods_for`: tidy rows (method, iter, phase, seconds); on a
    GPU the device is synchronised around every phase."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(seq_len, batch, input_size, generator=gen) < 0.3).float().to(device)  # bitstream-like inputs
    w = torch.randn(seq_len, batch, hidden, generator=gen).to(device)  # the loss: sum_t <w_t, h_t>, or <w_T, h_n>
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fns = {}
    mods = methods_for(layer, input_size, hidden, num_layers, L_ms, forwards=forwards, device=device)
    for name, (mod, ctx) in mods.items():
        opt = torch.optim.SGD(mod.parameters(), lr=1e-6)  # a real update, small enough to keep the weights

        def step(i: int, mod=mod, ctx=ctx, opt=opt) -> dict:
            opt.zero_grad(set_to_none=True)
            with ctx():
                sync()
                t0 = time.perf_counter()
                out, h_n = mod(x)
                obj = (out * w).sum() if loss == "steps" else (_finals(h_n)[-1] * w[-1]).sum()
                sync()
                t1 = time.perf_counter()
                obj.backward()
                sync()
                t2 = time.perf_counter()
                opt.step()
                sync()
                t3 = time.perf_counter()
            return {"forward": t1 - t0, "backward": t2 - t1, "sgd": t3 - t2}

        fns[name] = step
    if jax:  # torch.nn's layer, not yet stepped: the same weights as every other method's
        fns["jax"] = jax_step(mods["torch"][0], x, w, loss, lr=1e-6)
    m = interleave(fns, rule or StopRule(), reference="bppsa" if "bppsa" in fns else next(iter(fns)),
                   metric="backward")
    return pd.DataFrame(m.rows).assign(layer=layer, device=str(device), seq_len=seq_len, batch=batch, hidden=hidden,
                                       input_size=input_size, num_layers=num_layers, loss=loss,
                                       threads=torch.get_num_threads(), noisy=lambda d: d.method.map(m.noisy),
                                       subnormals=subnormal_mode())


def subnormal_mode() -> str:
    """``flushed`` where this thread flushes subnormal floats to zero (``torch.set_flush_denormal(True)``, the
    commands' default), else ``kept`` (a user's default): the rows record the mode they were timed in, since
    torch.nn's backward (not bppsa's scan, which flushes its own) slows down by up to ~100x on a subnormal."""
    return "flushed" if float(np.float32(1e-39) * np.float32(1.0)) == 0.0 else "kept"


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per phase and for the whole step (their sum): each method's median with its interval, and every paired
    ratio torch* / bppsa*."""
    wide = df.pivot_table(index=["method", "iter"], columns="phase", values="seconds").reset_index()
    phased = wide[list(PHASES)].notna().all(axis=1)
    wide["step"] = wide[list(PHASES)].sum(axis=1).where(phased, wide.get("step"))  # jax: its one phase
    rows = []
    methods = list(dict.fromkeys(df.method))
    for what in ("forward", "backward", "step"):
        per = {k: wide[wide.method == k].sort_values("iter")[what].to_numpy() for k in methods}
        per = {k: v for k, v in per.items() if not pd.isna(v).all()}  # jax has the step alone
        for k, v in per.items():
            med, lo, hi = median_ci(v)
            rows.append({"what": what, "ratio": k, "median": med, "ci_low": lo, "ci_high": hi, "n": len(v)})
        for num in (k for k in per if k.startswith(("torch", "jax"))):
            for den in (k for k in per if k.startswith("bppsa")):
                med, lo, hi = ratio_ci(per[num], per[den])
                rows.append({"what": what, "ratio": f"{num} / {den}", "median": med, "ci_low": lo, "ci_high": hi,
                             "n": len(per[num])})
    return pd.DataFrame(rows)
