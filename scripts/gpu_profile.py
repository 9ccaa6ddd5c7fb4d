"""Where one BPPSA training step's time goes on a GPU: host (cProfile) and device (torch.profiler).

For each case (model, T, B, layout) it times the step's phases with CUDA events (``jacobian`` runs inside
``backward``, whose time here includes it), then profiles the backward: the
torch/CUDA kernels by device time, the host functions by their own time, and the launches per backward.
Usage: python scripts/gpu_profile.py OUT_DIR [CASE ...]   CASE: rnn:1000:16:fused (model:T:B:layout)
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bppsa.backends import get_backend
from bppsa.models import build

DEFAULT = ["rnn:1000:16:fused", "rnn:1000:16:paper", "rnn:30000:16:fused", "gru:1034:16:fused"]


def case_data(model: str, T: int, B: int, dev):
    torch.manual_seed(0)
    I = 1 if model == "rnn" else 12
    net = build(model, I).to(dev)
    x = torch.randn(T, B, I, device=dev) if model == "gru" else torch.bernoulli(torch.full((T, B, I), 0.3, device=dev))
    y = torch.randint(0, 10, (B,), device=dev)
    return net, x, y


class Events:
    """CUDA-event phase timer (the bench's PhaseTimer in miniature)."""

    def __init__(self):
        self.marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event, float]] = []

    def __call__(self, name):
        outer = self

        class _Ctx:
            def __enter__(self):
                self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self.t = time.perf_counter()
                self.a.record()

            def __exit__(self, *exc):
                self.b.record()
                outer.marks.append((name, self.a, self.b, time.perf_counter() - self.t))
                return False

        return _Ctx()


def profile_case(spec: str, out: Path) -> str:
    model, T, B, layout = spec.split(":")
    T, B = int(T), int(B)
    dev = torch.device("cuda", 0)
    be = get_backend("auto", dev)
    net, x, y = case_data(model, T, B, dev)
    for _ in range(5):
        net.zero_grad(set_to_none=True)
        net.bppsa_step(x, y, be, layout)
    torch.cuda.synchronize()
    # phases: CUDA time and host time, median of 20
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(20):
        ev = Events()
        net.zero_grad(set_to_none=True)
        net.bppsa_step(x, y, be, layout, phase=ev)
        torch.cuda.synchronize()
        for name, a, b, host in ev.marks:
            rows.setdefault(name, []).append((a.elapsed_time(b), host * 1e3))
    lines = [f"== {spec} (backend {be.name}, {torch.cuda.get_device_name()})",
             "phase        CUDA-event ms   host ms (median of 20)"]
    for name, v in rows.items():
        cu = sorted(a for a, _ in v)[len(v) // 2]
        ho = sorted(b for _, b in v)[len(v) // 2]
        lines.append(f"{name:<12} {cu:>12.3f} {ho:>12.3f}")
    # the baseline's backward, for scale
    base = []
    for _ in range(10):
        net.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss.backward()
        b.record()
        torch.cuda.synchronize()
        base.append(a.elapsed_time(b))
    lines.append(f"cuDNN backward {sorted(base)[5]:.3f} ms (median of 10)")
    # device view: kernels of 5 backwards
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            net.zero_grad(set_to_none=True)
            net.bppsa_step(x, y, be, layout)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    lines.append("-- torch.profiler, 5 steps, by device time")
    lines.append(ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    lines.append("-- torch.profiler, 5 steps, by host self time")
    lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    # host view: cProfile of 20 backwards
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        net.zero_grad(set_to_none=True)
        net.bppsa_step(x, y, be, layout)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    lines.append("-- cProfile, 20 steps, by own time")
    lines.append(s.getvalue())
    text = "\n".join(lines)
    (out / f"profile_{spec.replace(':', '_')}.txt").write_text(text)
    return "\n".join(lines[:12])


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for spec in sys.argv[2:] or DEFAULT:
        try:
            print(profile_case(spec, out), flush=True)
        except Exception as exc:  # noqa: BLE001 - the next case still runs
            import traceback

            traceback.print_exc()
            print(f"{spec}: {type(exc).__name__}: {exc}", flush=True)
            failed.append(spec)
    if failed:
        print(f"gpu_profile: {len(failed)} case(s) failed: {' '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
