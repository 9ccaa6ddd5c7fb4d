"""The CPU speed benchmark of the recurrent backward (RNN, GRU or LSTM), on the shared timing protocol
(:mod:`.protocol`).

Per batch size, on the same weights, batch and chain, two interleaved groups of methods (every method
one iteration per round, so each ratio is a median of *paired* iterations):

``backward`` group (metric: Jacobian generation + backward, what BPPSA replaces):
* ``autograd``: ``loss.backward()`` of the baseline nn.RNN / nn.GRU / nn.LSTM (eager autograd through torch's own
  kernel: for the LSTM on a CPU that is oneDNN's fused kernel, the rival a user has);
* ``autograd-generic`` (the LSTM): the same with oneDNN off, torch's generic recurrent loop, as the RNN and the
  GRU always run;
* ``sequential``: the strongest sequential rival, built with BPPSA's care
  (``bppsa.backends.cpu.CpuBackend(sequential=True)``): the same forward, head and factored chain, the same
  compiled kernel, but T dependent mat-vecs and no matrix products, the batch split over the threads;
* ``bppsa-<backend>-<layout>[-L<L_m>]``: the BPPSA backward (Jacobians + scan + parameter gradients).

Every BPPSA method of the ``backward`` group runs torch's forward (``forward="torch"``), autograd's own: the group
compares backwards after the same forward, as the paper does.

``scan`` group (metric: the call): the scan alone over the real chain -- ``scan-sequential`` (the
compiled linear scan of the factored chain, what ``sequential`` runs), ``scan-cpu-chain`` (the fast
path's scan of the factored chain, what ``bppsa-cpu-fused`` runs), ``scan-<backend>`` (Blelloch over
the dense chain) and ``scan-linear-torch`` (the torch twin's sequential scan).

``step`` group (metric: the whole training step, forward + head + backward, no optimizer), on ``step_batches``:
* ``step-autograd``: the baseline's step (torch's forward, autograd's backward);
* ``step-bppsa-<backend>-<layout>[-L<L_m>]``: BPPSA's step with torch's forward (``forward="torch"``): the
  paper's overall comparison, the same forward on both sides;
* ``step-bppsa-<backend>-<layout>[-L<L_m>]-compiled``: BPPSA's step with the backend's own forward
  (``forward="auto"``: the CPU's compiled kernel, split over slices of the sequence where the layer's
  ``parallel_forward=None`` finds that pays; ``forward_sliced`` records the share of its calls that were), a
  variant of its own, never in the paper's comparison.  Not timed where this machine has no compiled forward
  (it would time torch's forward twice under two names).
Each step method's gradients are checked against autograd's from the same weights first (the dtype's tolerance).

Rows: ``batch, group, method, iter, phase, seconds`` plus the method's ``backend, layout, L_m, forward`` and
its ``noisy`` flag; :func:`summary` turns them into paired ratios with intervals.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from ..backends import get_backend
from ..data.sequences import open_dataset
from ..models import build, copy_model
from ..models.recurrent import no_phase
from ..scan import linear_scan
from ..stats import ratio_ci
from .protocol import TOTAL, StopRule, interleave
from .recurrent import compiled_forward_here
from .timing import PhaseTimer, backward_seconds, timed

SEQUENTIAL, AUTOGRAD, AUTOGRAD_GENERIC = "sequential", "autograd", "autograd-generic"
FUSED_ON_CPU = ("lstm",)  # the models whose torch kernel on a CPU is oneDNN's fused one, not the generic loop
SCAN_SEQUENTIAL = "scan-sequential"
STEP, COMPILED = "step-", "-compiled"  # the step group's prefix; the suffix of its compiled-forward variants
STEP_AUTOGRAD = STEP + AUTOGRAD


BITSTREAM_MODELS = ("rnn", "lstm")  # the models whose task is Sec 4.1's bitstreams


def bppsa_name(backend: str, layout: str, L_m) -> str:
    return f"bppsa-{backend}-{layout}" + ("" if L_m is None else f"-L{L_m}")


def bitstream_batch(seq_len: int, B: int, seed: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A bitstream-like batch: sample b is Bernoulli with a rate set by its class."""
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 10, B)
    x = (rng.random((seq_len, B, 1)) < (0.05 + 0.1 * c)[None, :, None]).astype(np.float32)
    return torch.from_numpy(x).to(dtype), torch.from_numpy(c.astype(np.int64))


def setup(model: str, B: int, seed: int, dtype, seq_len: int | None = None, hidden: int | None = None,
          data: str | None = None):
    """(model, x, y) for one configuration: the RNN or the LSTM on a bitstream batch of ``seq_len``; a model on the
    first B samples of a dataset file (``data``, e.g. an MFCC set for the GRU)."""
    if data is None:
        if model not in BITSTREAM_MODELS or seq_len is None:
            raise ValueError(f"the {model.upper()} speed benchmark reads its inputs from a dataset file (--data)")
        x, y = bitstream_batch(seq_len, B, seed, dtype)
        classes = None
    else:
        ds = open_dataset(data, dtype)
        if ds.n < B:
            raise ValueError(f"{data}: {ds.n} samples, fewer than one batch of {B}")
        x, y = ds.get_batch(np.arange(B))
        classes = ds.classes
    torch.manual_seed(seed)
    return build(model, x.shape[2], hidden, classes).to(dtype), x, y


def sequential_backend():
    from ..backends.cpu import CpuBackend

    return CpuBackend(sequential=True)


def _phased(step):
    """A protocol callable: one zeroed-gradient iteration of ``step(phase)``, seconds per phase."""
    timer = PhaseTimer(torch.device("cpu"))

    def run(i: int) -> dict:
        step(timer.phase)
        return timer.collect()

    return run


def backward_methods(model, x, y, backends=("cpu",), layouts=("fused",), L_ms=(None,)) -> dict:
    """name -> (protocol callable, attributes) for the backward group."""
    out = {}

    def model_step(fn):
        m = copy_model(model)

        def step(phase):
            m.zero_grad(set_to_none=True)
            fn(m, phase)

        return _phased(step)

    seq = sequential_backend()
    out[AUTOGRAD] = (model_step(lambda m, ph: m.baseline_step(x, y, phase=ph)), {"backend": "autograd",
                                                                                   "forward": "torch"})
    if model.model in FUSED_ON_CPU:
        def generic(m, ph):
            with torch.backends.mkldnn.flags(enabled=False):
                m.baseline_step(x, y, phase=ph)

        out[AUTOGRAD_GENERIC] = (model_step(generic), {"backend": "autograd", "forward": "torch"})
    # forward="torch" throughout: this group times the backward, after the same forward as autograd's
    out[SEQUENTIAL] = (model_step(lambda m, ph: m.bppsa_step(x, y, seq, "fused", phase=ph, forward="torch")),
                       {"backend": seq.name, "layout": "fused", "L_m": 0, "forward": "torch"})
    for be in backends:
        for layout in layouts:
            for L_m in L_ms:
                backend = get_backend(be, torch.device("cpu"))

                def fn(m, ph, b=backend, lay=layout, L=L_m):
                    m.bppsa_step(x, y, b, lay, L, phase=ph, forward="torch")

                out[bppsa_name(backend.name, layout, L_m)] = (model_step(fn), {
                    "backend": backend.name, "layout": layout, "L_m": L_m, "forward": "torch"})
    return out


def step_methods(model, x, y, backends=("cpu",), layouts=("fused",), L_ms=(None,), tol: float | None = None) -> dict:
    """name -> (protocol callable, attributes) for the step group (the module's docstring), each method's gradients
    first checked against autograd's (relative to each parameter's largest, within ``tol``; None: the dtype's)."""
    from ..precision import TOLERANCE
    from ..verify import grad_errors

    dtype = str(x.dtype).removeprefix("torch.")
    tol = TOLERANCE[dtype] if tol is None else tol
    compiled = compiled_forward_here(model, x)
    if not compiled:
        print(f"bppsa speed: no compiled forward for the {model.model.upper()} here ({x.dtype}, {x.device}): the "
              f"step group's '{COMPILED}' variants are not timed", file=sys.stderr)
    ref = copy_model(model)
    ref.baseline_step(x, y)
    out = {}

    def add(name, step, attrs):
        m = copy_model(model)
        step(m, no_phase)  # the check: one step from the same weights as autograd's
        err = max(grad_errors(ref, m).values())
        if not err <= tol:
            raise RuntimeError(f"{name}: its gradients differ from autograd's by {err:.2e} (relative), beyond {tol:g}")
        attrs = {**attrs, "forward_sliced": math.nan}
        calls = [0, 0]  # the step's calls, and those whose forward ran sliced

        def run(ph):
            m.zero_grad(set_to_none=True)
            step(m, ph)
            calls[0] += 1
            calls[1] += any(s is not None for s in getattr(m.cell, "forward_stats", []))
            attrs["forward_sliced"] = calls[1] / calls[0]  # read by measure() once the timing is done

        out[name] = (_phased(run), attrs)

    add(STEP_AUTOGRAD, lambda m, ph: m.baseline_step(x, y, phase=ph), {"backend": "autograd", "forward": "torch"})
    for be in backends:
        backend = get_backend(be, torch.device("cpu"))
        for layout in layouts:
            for L_m in L_ms:
                name = STEP + bppsa_name(backend.name, layout, L_m)
                for fwd, suffix in (("torch", ""), ("auto", COMPILED)):
                    if fwd == "auto" and not compiled:
                        continue

                    def step(m, ph, b=backend, lay=layout, L=L_m, f=fwd):
                        m.bppsa_step(x, y, b, lay, L, phase=ph, forward=f)

                    add(name + suffix, step, {"backend": backend.name, "layout": layout, "L_m": L_m, "forward": fwd})
    return out


def scan_methods(model, x, y, backends=("cpu",), L_m=None, check_tol: float = 1e-4) -> dict:
    """name -> (protocol callable, attributes) for the scan-alone group over the model's own chain, each
    checked against the torch twin's sequential scan first."""
    with torch.no_grad():
        h, _ = model.cell(x)
    h_last = h[-1].detach().requires_grad_(True)
    F.cross_entropy(model.head(h_last), y).backward()
    g, h = h_last.grad, h.detach()
    cell = model.cell.cell
    if cell.cell_state:  # the state's gradient: (∇h_T, ∇c_T = 0)
        g = cell.state(g, g.new_zeros((g.shape[0], model.cell.hidden_size)))
    with torch.no_grad():
        J = model.jacobians_t(x, h, "fused", get_backend("torch")).clone()
    fns = {"scan-linear-torch": (lambda: linear_scan(g, J), {"backend": "torch", "L_m": 0})}
    for be in backends:
        backend = get_backend(be, torch.device("cpu"))
        fns[f"scan-{backend.name}"] = (lambda b=backend: b.scan(g, J, L_m), {"backend": backend.name, "L_m": L_m})
        if backend.name == "cpu":
            with torch.no_grad():
                chain = model.jacobians_t(x, h, "fused", backend)
            seq = sequential_backend()
            fns[SCAN_SEQUENTIAL] = (lambda c=chain, s=seq: s.scan(g, c), {"backend": seq.name, "L_m": 0})
            fns["scan-cpu-chain"] = (lambda b=backend, c=chain: b.scan(g, c, L_m), {"backend": "cpu", "L_m": L_m})
    ref = linear_scan(g, J)
    scale = ref.abs().max().clamp_min(torch.finfo(ref.dtype).tiny)
    for name, (fn, _) in fns.items():
        err = ((fn() - ref).abs().max() / scale).item()
        if not err <= check_tol:
            raise RuntimeError(f"{name} disagrees with the sequential torch scan (rel. err {err:.2e} > {check_tol})")
    return {name: (lambda i, fn=fn: {"total": timed(fn)[0]}, attrs) for name, (fn, attrs) in fns.items()}


def measure(methods: dict, rule: StopRule, reference: str, metric, **labels) -> list[dict]:
    """Interleave ``methods`` under ``rule``; tidy rows labelled with ``labels`` and each method's attributes."""
    m = interleave({k: fn for k, (fn, _) in methods.items()}, rule, reference=reference, metric=metric)
    rows = []
    for r in m.rows:
        attrs = methods[r["method"]][1]
        rows.append({**labels, **r, "backend": attrs.get("backend"), "layout": attrs.get("layout"),
                     "L_m": attrs.get("L_m"), "forward": attrs.get("forward"),
                     "forward_sliced": attrs.get("forward_sliced", math.nan), "noisy": m.noisy[r["method"]],
                     "stopped_by": m.stopped_by})
    return rows


def run(seq_len: int | None, batches: list[int], hidden: int | None = None, layouts=("fused",), L_ms=(None,),
        backends=("cpu", "torch"), rule: StopRule | None = None, seed: int = 0, dtype=torch.float32,
        groups=("backward", "scan", "step"), model: str = "rnn", data: str | None = None,
        step_batches: list[int] | None = None) -> list[dict]:
    """Every group's rows at every batch size of ``batches``; the step group at ``step_batches`` (None: the same)."""
    rule = rule or StopRule()
    step_batches = list(batches if step_batches is None else step_batches)
    rows = []
    for B in list(dict.fromkeys([*batches, *step_batches])):
        net, x, y = setup(model, B, seed, dtype, seq_len, hidden, data)
        labels = {"model": model, "batch": B, "seq_len": x.shape[0], "hidden": net.cell.hidden_size,
                  "input_size": x.shape[2]}
        if "backward" in groups and B in batches:
            rows += measure(backward_methods(net, x, y, backends, layouts, L_ms), rule, AUTOGRAD,
                            backward_seconds, group="backward", **labels)
        if "step" in groups and B in step_batches:
            rows += measure(step_methods(net, x, y, backends, layouts, L_ms), rule, STEP_AUTOGRAD, TOTAL,
                            group="step", **labels)
        if "scan" in groups and B in batches:
            rows += measure(scan_methods(net, x, y, backends), rule, SCAN_SEQUENTIAL
                            if "cpu" in backends else "scan-linear-torch", "total", group="scan", **labels)
    return rows


def _per_iter(df: pd.DataFrame) -> pd.DataFrame:
    """One value per (batch, group, method, iter): the group's metric."""
    bwd = df[(df["group"] == "backward") & df["phase"].isin(["jacobian", "backward"])]
    scan = df[(df["group"] == "scan") & (df["phase"] == "total")]
    step = df[df["group"] == "step"]  # every phase: forward, jacobian, backward
    keys = ["batch", "group", "method", "iter"]
    return pd.concat([d.groupby(keys, as_index=False)["seconds"].sum() for d in (bwd, scan, step)])


def summary(df: pd.DataFrame, conf: float = 0.95) -> pd.DataFrame:
    """Paired speed ratios with intervals: per batch, ``autograd / bppsa-*`` and ``sequential / bppsa-*``
    (backward), ``scan-sequential / scan-*`` and ``scan-linear-torch / scan-*`` (scan alone), and for the whole
    step ``step-autograd / step-bppsa-*`` (with torch's forward on both sides: the paper's overall comparison; and
    against each ``-compiled`` variant) and ``step-bppsa-X / step-bppsa-X-compiled`` (what the compiled forward buys
    BPPSA's step).

    Columns: batch, ratio, median, ci_low, ci_high, n, noisy (either side was marked noisy by the
    protocol), plus the medians of the two sides in seconds.
    """
    per = _per_iter(df)
    noisy = df.groupby(["batch", "group", "method"])["noisy"].any()
    out = []
    for (B, group), d in per.groupby(["batch", "group"]):
        wide = d.pivot(index="iter", columns="method", values="seconds")
        if group == "backward":
            dens = [c for c in wide.columns if c.startswith("bppsa-")]
            pairs = [(num, den) for den in dens for num in (AUTOGRAD, AUTOGRAD_GENERIC, SEQUENTIAL)]
        elif group == "step":
            dens = [c for c in wide.columns if c.startswith(STEP + "bppsa-")]
            pairs = [(STEP_AUTOGRAD, den) for den in dens] + [(den.removesuffix(COMPILED), den) for den in dens
                                                              if den.endswith(COMPILED)]
        else:
            nums = [SCAN_SEQUENTIAL, "scan-linear-torch"]
            pairs = [(num, den) for den in wide.columns if den not in nums for num in nums]
        for num, den in pairs:
            if num not in wide.columns:
                continue
            ok = wide[num].notna() & wide[den].notna()
            med, lo, hi = ratio_ci(wide[num][ok].to_numpy(), wide[den][ok].to_numpy(), conf)
            out.append({"batch": int(B), "ratio": f"{num} / {den}", "median": med, "ci_low": lo, "ci_high": hi,
                        "n": int(ok.sum()), "noisy": bool(noisy.get((B, group, num), False)
                                                          or noisy.get((B, group, den), False)),
                        "num_s": float(np.median(wide[num][ok])) if ok.any() else math.nan,
                        "den_s": float(np.median(wide[den][ok])) if ok.any() else math.nan})
    return pd.DataFrame(out, columns=["batch", "ratio", "median", "ci_low", "ci_high", "n", "noisy", "num_s", "den_s"])
