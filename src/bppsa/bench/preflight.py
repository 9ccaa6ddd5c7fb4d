"""The paper profile's extreme shapes, checked before a GPU user meets them (`bppsa paper-shapes`).

For every extreme configuration of a config file (the longest RNN at its batch, the widest RNN batch at
its length, both layouts; the GRU on the longest MFCC set at the largest batch; the full VGG-11 training
step and one sample of its FLOP analysis) this module

* runs the exactness check of ``bppsa verify`` and a few timed rounds of the autograd baseline and the
  BPPSA backward on the CPU (backend ``auto``: the CPU fast path), on synthetic inputs of the right shape;
* measures the peak host memory of the job, each job in its own subprocess (``ru_maxrss``);
* computes the GPU memory the same job would need (:func:`recurrent_gpu_bytes`, :func:`vgg_gpu_bytes`),
  term by term, from how the CUDA path allocates; ``tests/test_paper_shapes.py`` holds every term to
  the bytes of the tensors the code really allocates at a small shape, so the formula cannot drift.

Nothing here is a hard-coded shape: the configurations come from the config file (:func:`extreme_jobs`).
"""
from __future__ import annotations

import copy
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ..backends.cuda.memory_model import CAPACITIES_GB, GB, fits, recurrent_gpu_bytes, vgg_gpu_bytes


# -- the configuration ------------------------------------------------------------------------------
def cfg_get(cfg: Mapping, key: str, source: str = "config"):
    """``cfg['a']['b']`` for ``key='a.b'``, or a ValueError naming the key."""
    cur = cfg
    for part in key.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise ValueError(f"{source}: config key '{key}' is missing (bppsa paper-shapes needs it)")
        cur = cur[part]
    return cur


def _positive_ints(values, key: str, source: str) -> list[int]:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{source}: config key '{key}' must be a non-empty list (got {values!r})")
    out = []
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{source}: config key '{key}' holds {v!r}; expected positive integers")
        out.append(v)
    return out


def load_config(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} does not exist")
    cfg = yaml.safe_load(p.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: not a YAML mapping")
    return cfg


def _scaled(n: int, scale: float) -> int:
    return max(1, math.ceil(n * scale))


def extreme_jobs(cfg: Mapping, source: str = "config", vgg_flops: bool = True, scale: float = 1.0) -> list[dict]:
    """The extreme configurations of a config, as JSON-ready job descriptions (one subprocess each).

    ``scale`` (< 1 for tests) multiplies every sequence length and batch size, rounding up."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    from ..data.irmas import mfcc_set
    from ..models import SPECS

    g = lambda k: cfg_get(cfg, k, source)  # noqa: E731
    dtype, seed = g("dtype"), int(cfg.get("seed", 0))
    if dtype not in ("float32", "float64"):
        raise ValueError(f"{source}: config key 'dtype' is {dtype!r}; expected float32 or float64")
    jobs = []
    rnn_T, rnn_B = max(_positive_ints(g("rnn.seq_lens"), "rnn.seq_lens", source)), int(g("rnn.batch_at_seq_len"))
    wide_T, wide_B = int(g("rnn.seq_len_at_batch")), max(_positive_ints(g("rnn.batches"), "rnn.batches", source))
    layouts = g("rnn.layouts")
    if not layouts:
        raise ValueError(f"{source}: config key 'rnn.layouts' is empty")
    rnn_T, rnn_B, wide_T, wide_B = (_scaled(v, scale) for v in (rnn_T, rnn_B, wide_T, wide_B))
    for layout in layouts:
        if layout not in SPECS["rnn"].layouts:
            raise ValueError(f"{source}: config key 'rnn.layouts' holds {layout!r} (known: {SPECS['rnn'].layouts})")
        common = dict(kind="recurrent", model="rnn", layout=layout, hidden=int(g("rnn.hidden")),
                      input_size=SPECS["rnn"].input_size, classes=SPECS["rnn"].classes, dtype=dtype, seed=seed,
                      L_m=g("rnn.L_m"), host_class="verify")
        jobs.append(dict(common, name=f"rnn-{layout} max seq_len", seq_len=rnn_T, batch=rnn_B,
                         why="max(rnn.seq_lens) at rnn.batch_at_seq_len"))
        jobs.append(dict(common, name=f"rnn-{layout} max batch", seq_len=wide_T, batch=wide_B,
                         why="rnn.seq_len_at_batch at max(rnn.batches)"))
    sets = g("gru.sets")
    if not sets:
        raise ValueError(f"{source}: config key 'gru.sets' is empty")
    longest = max(sets, key=lambda s: mfcc_set(s).frames)
    ms = mfcc_set(longest)
    jobs.append(dict(kind="recurrent", model="gru", layout="fused", hidden=int(g("gru.hidden")),
                     input_size=ms.features, classes=SPECS["gru"].classes, dtype=dtype, seed=seed, L_m=None,
                     name=f"gru set {longest.upper()} max batch", seq_len=_scaled(ms.frames, scale),
                     batch=_scaled(max(_positive_ints(g("gru.batches"), "gru.batches", source)), scale),
                     host_class="verify",
                     why=f"the longest set of gru.sets ({longest}: {ms.frames} frames x {ms.features} features, "
                         "bppsa.data.irmas.MFCC_SETS) at max(gru.batches)"))
    width, batch = float(g("vgg11.width")), _scaled(int(g("vgg11.batch_size")), scale)
    jobs.append(dict(kind="vgg-train", model="vgg11", name="vgg11 train step", width=width, batch=batch,
                     dtype=dtype, seed=seed, lr=float(g("vgg11.lr")), weight_decay=float(g("vgg11.weight_decay")),
                     host_class="train", why="vgg11.width at vgg11.batch_size (SGD momentum 0.9, as vgg11-train)"))
    if vgg_flops:
        fl = g("vgg11.flops")
        for net in cfg_get(cfg, "vgg11.flops.networks", source):
            jobs.append(dict(kind="vgg-flops", model="vgg11", name=f"vgg11 flops {net}", network=net, width=width,
                             batch=1, dtype=str(cfg_get(cfg, "vgg11.flops.dtype", source)), seed=seed,
                             L_m=fl.get("L_m"), drop_zeros=bool(cfg_get(cfg, "vgg11.flops.drop_zeros", source)),
                             dense_limit_gb=float(cfg_get(cfg, "vgg11.flops.dense_limit_gb", source)),
                             prune=float(g("vgg11.prune.fraction")), scheme=str(g("vgg11.prune.scheme")),
                             host_class="analysis",
                             why="one sample of vgg11-flops (CSR Jacobians, scipy: a CPU job) at vgg11.width"))
    return jobs


# -- running one job (in its own process) -----------------------------------------------------------
def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _median_ms(xs) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def _run_recurrent(job: dict, rounds: int, fp64: bool) -> dict:
    import torch

    from ..backends import get_backend
    from ..bench.recurrent import train_step
    from ..bench.timing import PhaseTimer, backward_seconds
    from ..models import build, copy_model
    from ..precision import DTYPES
    from ..verify import verify

    T, B, H, I, C = job["seq_len"], job["batch"], job["hidden"], job["input_size"], job["classes"]
    out: dict = {}
    t0 = time.perf_counter()
    for dt in [job["dtype"]] + (["float64"] if fp64 and job["dtype"] != "float64" else []):
        r = verify(job["model"], T, B, H, I, C, dtype=dt, backend="auto", layout=job["layout"], L_m=job["L_m"],
                   seed=job["seed"], device="cpu")
        out[f"max_rel_err_{dt}"] = r["max_rel_err"]
        out[f"ok_{dt}"] = bool(r["ok"])
        out["backend"] = r["backend"]
    out["verify_s"] = time.perf_counter() - t0
    out["peak_rss_after_verify_mb"] = _peak_rss_mb()

    dtype = DTYPES[job["dtype"]]
    torch.manual_seed(job["seed"])
    ref = build(job["model"], I, H, C).to(dtype=dtype)
    models = {"baseline": ref, "bppsa": copy_model(ref)}
    g = torch.Generator().manual_seed(job["seed"] + 2)
    x = (torch.bernoulli(torch.full((T, B, I), 0.5), generator=g) if job["model"] == "rnn"
         else torch.randn(T, B, I, generator=g)).to(dtype)
    y = torch.randint(0, C, (B,), generator=g)
    backend = get_backend("auto", torch.device("cpu"))
    timer = PhaseTimer(torch.device("cpu"))
    times: dict[str, dict[str, list]] = {m: {"forward": [], "backward": []} for m in models}
    t0 = time.perf_counter()
    for i in range(rounds + 1):  # round 0 warms up, untimed
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        for m in order:
            models[m].zero_grad(set_to_none=True)
            train_step(models[m], x, y, m, backend if m == "bppsa" else None, job["layout"], job["L_m"], timer=timer)
            ph = timer.collect()
            if i:
                times[m]["forward"].append(ph.get("forward", 0.0))
                times[m]["backward"].append(backward_seconds(ph))  # BPPSA's includes its Jacobians
    out["timing_s"] = time.perf_counter() - t0
    for m in models:
        out[f"{m}_forward_ms"] = _median_ms(times[m]["forward"])
        out[f"{m}_backward_ms"] = _median_ms(times[m]["backward"])
    return out


def saved_activation_bytes(model, x, y) -> int:
    """Bytes autograd keeps for the backward of ``cross_entropy(model(x), y)``: one count per storage,
    parameters and the batch itself (``x``, ``y``) excluded (``torch.autograd.graph.saved_tensors_hooks``)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    del loss
    return sum(seen.values())


def _run_vgg_train(job: dict, rounds: int) -> dict:
    import torch

    from ..models.vgg import VGG11
    from ..precision import DTYPES

    dtype = DTYPES[job["dtype"]]
    torch.manual_seed(job["seed"])
    model = VGG11(width=job["width"]).to(dtype=dtype)
    g = torch.Generator().manual_seed(job["seed"] + 2)
    x = torch.randn(job["batch"], 3, 32, 32, generator=g).to(dtype)
    y = torch.randint(0, 10, (job["batch"],), generator=g)
    out = {"saved_activations_measured_mb": saved_activation_bytes(model, x, y) / 2**20}
    opt = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=0.9, weight_decay=job["weight_decay"])
    fwd, bwd, step = [], [], []
    t_all = time.perf_counter()
    for i in range(rounds + 1):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            step.append(t3 - t0)
    out.update(timing_s=time.perf_counter() - t_all, baseline_forward_ms=_median_ms(fwd),
               baseline_backward_ms=_median_ms(bwd), train_step_ms=_median_ms(step), backend="autograd")
    return out


def _run_vgg_flops(job: dict, fp64: bool) -> dict:
    """One sample of the FLOP analysis (``bppsa vgg11-flops``'s ``analyse_sample``), its CSR Jacobians' size,
    and the exactness of its scan against autograd (every activation's gradient)."""
    import numpy as np
    import torch

    from .. import flops as fl
    from ..models import vgg

    torch.manual_seed(job["seed"])
    net = vgg.VGG11(width=job["width"])
    if job["network"] == "pruned":
        vgg.apply_masks(net, vgg.magnitude_masks(net, job["prune"], job["scheme"]))
    net.eval()
    gen = torch.Generator().manual_seed(job["seed"] + 2)
    x0 = torch.rand(1, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (1,), generator=gen)
    out: dict = {"backend": "scipy-csr"}
    dtypes = [job["dtype"]] + (["float64"] if fp64 and job["dtype"] != "float64" else [])
    t_all = time.perf_counter()
    for dt in dtypes:
        tdt = torch.float64 if dt == "float64" else torch.float32
        m = copy.deepcopy(net).to(tdt)
        x = x0.to(tdt)
        acts = [x.clone().requires_grad_(True)]
        for layer in m.features:
            a = layer(acts[-1])
            a.retain_grad()
            acts.append(a)
        torch.nn.functional.cross_entropy(m.classifier(acts[-1].flatten(1)), y).backward()
        t0 = time.perf_counter()
        J, _, _ = fl.layer_chain(m.features, x[0], drop_zeros=job["drop_zeros"], dtype=np.dtype(dt))
        if dt == job["dtype"]:
            out["jacobians_csr_mb"] = sum(j.data.nbytes + j.indices.nbytes + j.indptr.nbytes for j in J) / 2**20
        del J
        res = fl.analyse_sample(m.features, x[0].detach(), acts[-1].grad[0], job["L_m"], drop_zeros=job["drop_zeros"],
                                dtype=np.dtype(dt), dense_limit_bytes=int(job["dense_limit_gb"] * 2**30))
        secs = time.perf_counter() - t0
        n = len(res["scan"])
        err = 0.0
        for k, got in enumerate(res["scan"]):  # prefix k is the gradient of the input of layer n - k
            ref = acts[n - k].grad[0].detach().double().numpy().reshape(-1)
            scale = np.abs(ref).max()
            err = max(err, float(np.abs(np.asarray(got, np.float64) - ref).max() / (scale if scale > 0 else 1.0)))
        out[f"max_rel_err_{dt}"] = err
        out[f"ok_{dt}"] = err <= {"float32": 1e-4, "float64": 1e-10}[dt]
        if dt == job["dtype"]:
            out["flops_sample_s"] = secs
            s = fl.flop_summary(res["ops"])
            out["note"] = (f"{n} Jacobians; BPPSA critical path {s['bppsa_critical_flop']:.3g} FLOP, "
                           f"BP {s['baseline_total_flop']:.3g} FLOP")
        del res
    out["timing_s"] = time.perf_counter() - t_all
    return out


def run_job(job: dict, rounds: int = 3, fp64: bool = True, threads: int = 0) -> dict:
    """Run one job in this process; returns measurements, including this process's peak RSS so far."""
    import torch

    from ..backends.cpu.pool import flushing

    old_threads, old_flush = torch.get_num_threads(), flushing()
    if threads:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as the commands do by default
    try:
        t0 = time.perf_counter()
        if job["kind"] == "recurrent":
            res = _run_recurrent(job, rounds, fp64)
        elif job["kind"] == "vgg-train":
            res = _run_vgg_train(job, rounds)
        elif job["kind"] == "vgg-flops":
            res = _run_vgg_flops(job, fp64)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r}")
        res["wall_s"] = time.perf_counter() - t0
        res["peak_rss_mb"] = _peak_rss_mb()
        res["threads"] = torch.get_num_threads()
    finally:  # in-process runs (tests) leave the caller's settings as they were
        torch.set_num_threads(old_threads)
        torch.set_flush_denormal(old_flush)
    return res


def idle_rss_mb() -> float:
    """Peak RSS of a subprocess that only imports torch and this package: what every job's figure includes."""
    code = "import torch, bppsa.bench.preflight as s, resource; print(s._peak_rss_mb())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RuntimeError(f"the idle-RSS probe failed: {r.stderr.strip()[-500:]}")
    return float(r.stdout.strip().splitlines()[-1])


def run_job_subprocess(job: dict, rounds: int, fp64: bool, threads: int = 0, timeout: float | None = None) -> dict:
    """:func:`run_job` in a fresh Python process, so ``ru_maxrss`` is this job's alone."""
    args = json.dumps(dict(job=job, rounds=rounds, fp64=fp64, threads=threads))
    try:
        r = subprocess.run([sys.executable, "-m", "bppsa.bench.preflight", args], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"not finished within {timeout:.0f} s (--job-timeout)"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {r.returncode}: {tail}"}
    return json.loads(lines[-1])


# -- rows of the table ------------------------------------------------------------------------------
def memory_row(job: dict) -> dict:
    """The computed GPU requirement of a job (GB) and its fits flags; empty for a CPU-only job."""
    s = 8 if job["dtype"] == "float64" else 4
    if job["kind"] == "recurrent":
        m = recurrent_gpu_bytes(job["model"], job["seq_len"], job["batch"], job["hidden"], job["input_size"],
                                job["classes"], job["layout"], s, job["L_m"])
        bp, base = sum(m["bppsa"].values()), sum(m["baseline"].values())
        # the bench runs both methods in one process and the caching allocator may keep both: count both
        job_bytes = bp + base
        row = dict(gpu_jacobians_gb=m["bppsa"]["jacobians"] / GB, gpu_bppsa_gb=bp / GB, gpu_baseline_gb=base / GB,
                   gpu_job_gb=job_bytes / GB)
    elif job["kind"] == "vgg-train":
        from ..models.vgg import VGG11, feature_shapes

        params = sum(p.numel() for p in VGG11(width=job["width"]).parameters())
        m = vgg_gpu_bytes(params, feature_shapes(job["width"]), job["batch"], s)
        job_bytes = sum(m.values())
        row = dict(gpu_jacobians_gb=float("nan"), gpu_bppsa_gb=float("nan"), gpu_baseline_gb=job_bytes / GB,
                   gpu_job_gb=job_bytes / GB, gpu_saved_activations_gb=m["saved_activations"] / GB)
    else:
        return dict(gpu_jacobians_gb=float("nan"), gpu_bppsa_gb=float("nan"), gpu_baseline_gb=float("nan"),
                    gpu_job_gb=float("nan"), fits_16gb=None, fits_80gb=None)
    for cap in CAPACITIES_GB:
        row[f"fits_{cap}gb"] = fits(job_bytes, cap)
    return row


COLUMNS = ["name", "model", "layout", "seq_len", "batch", "hidden", "input_size", "width", "dtype", "backend",
           "max_rel_err_float32", "max_rel_err_float64", "exact", "baseline_forward_ms", "baseline_backward_ms",
           "bppsa_forward_ms", "bppsa_backward_ms", "train_step_ms", "rounds", "peak_rss_mb", "idle_rss_mb",
           "host_mem_limit_mb", "fits_host_limit", "gpu_jacobians_gb", "gpu_bppsa_gb", "gpu_baseline_gb",
           "gpu_job_gb", "fits_16gb", "fits_80gb", "wall_s", "why", "note"]


def table_row(job: dict, res: dict, cfg: Mapping, rounds: int, idle_mb: float) -> dict:
    row = {k: job.get(k) for k in ("name", "model", "layout", "seq_len", "batch", "hidden", "input_size", "width",
                                   "dtype", "why")}
    row.update({k: res.get(k) for k in ("backend", "max_rel_err_float32", "max_rel_err_float64",
                                        "baseline_forward_ms", "baseline_backward_ms", "bppsa_forward_ms",
                                        "bppsa_backward_ms", "train_step_ms", "peak_rss_mb", "wall_s")})
    oks = [v for k, v in res.items() if k.startswith("ok_")]
    row["exact"] = all(oks) if oks else None
    row["rounds"] = rounds if job["kind"] != "vgg-flops" else 1
    row["idle_rss_mb"] = idle_mb
    limit = cfg.get("resources", {}).get(job["host_class"], {}).get("mem_mb") if isinstance(
        cfg.get("resources"), Mapping) else None
    row["host_mem_limit_mb"] = limit
    row["fits_host_limit"] = (res["peak_rss_mb"] <= limit) if (limit and "peak_rss_mb" in res) else None
    row.update(memory_row(job))
    notes = [res["note"]] if res.get("note") else []
    if job["kind"] == "vgg-flops":
        notes.append("CPU-only job (scipy): no GPU figure")
        if "jacobians_csr_mb" in res:
            notes.append(f"CSR Jacobians {res['jacobians_csr_mb'] * 2**20 / GB:.3g} GB")
    if "saved_activations_measured_mb" in res:
        notes.append(f"autograd saved {res['saved_activations_measured_mb'] * 2**20 / GB:.3g} GB (measured with "
                     "saved_tensors_hooks on this CPU; the formula's term: "
                     f"{row.get('gpu_saved_activations_gb', float('nan')):.3g} GB)")
    if "error" in res:
        notes.append(f"NOT RUN: {res['error']}")
    row["note"] = "; ".join(notes)
    return row


def main(argv: list[str] | None = None) -> int:
    """Child entry point: ``python -m bppsa.bench.preflight '<json>'`` prints one JSON line of results."""
    from .. import process

    process.keep_large_blocks()  # the CLI's allocator setting, before torch works (the OpenMP one came with bppsa)

    spec = json.loads((argv or sys.argv[1:])[0])
    res = run_job(spec["job"], spec["rounds"], spec["fp64"], spec.get("threads", 0))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
