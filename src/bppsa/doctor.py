"""`bppsa doctor`: what this machine can run, checked end to end, and what to fix.

It records the device, the NVIDIA driver, torch and its CUDA build, cuDNN, CuPy and the NVRTC it
loads, and the shared memory per block.  It compiles the kernels (through CuPy on a GPU; through
the NVRTC wheel with CuPy's options otherwise), then runs, per backend on the selected device, a
short scan against the sequential scan and a `verify` (BPPSA against autograd, fp64 and fp32).
"""
from __future__ import annotations

import concurrent.futures
import platform
import subprocess
import warnings

import torch

from . import backends as _backends
from . import device as _device
from .scan import linear_scan

SCAN_SHAPE = (37, 3, 8)  # n, B, H: n + 1 = 38 positions, not a power of two
SCAN_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
VERIFY = [dict(model="rnn", seq_len=17, batch=5, hidden=20, dtype="float64", layout="fused"),
          dict(model="rnn", seq_len=17, batch=5, hidden=20, dtype="float32", layout="paper"),
          dict(model="gru", seq_len=9, batch=3, hidden=8, dtype="float64", layout="fused")]
NVRTC_ARCHS = (90, 80, 75)  # what the kernels must compile for where no GPU says which one it is


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _loaded_libraries(fragment: str) -> list[str]:
    """Paths of shared libraries mapped into this process whose name contains ``fragment`` (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if fragment in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def cupy_info() -> dict:
    info: dict = {"installed": False}
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001
        info["reason"] = _first_line(exc)
        return info
    info.update(installed=True, version=cupy.__version__)
    try:
        from cupy.cuda import nvrtc as cupy_nvrtc

        info["nvrtc"] = ".".join(str(v) for v in cupy_nvrtc.getVersion())
        info["nvrtc_library"] = _loaded_libraries("libnvrtc.") or None
    except Exception as exc:  # noqa: BLE001 - CuPy without a loadable NVRTC cannot compile the kernels
        info["nvrtc"] = None
        info["nvrtc_reason"] = _first_line(exc)
    try:
        v = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_runtime"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception as exc:  # noqa: BLE001
        info["cuda_runtime"] = None
        info["cuda_runtime_reason"] = _first_line(exc)
    return info


def nvrtc_compile(archs: tuple[int, ...]) -> dict:
    """The kernels through the NVRTC wheel, with CuPy's effective options (no GPU needed)."""
    from .backends.cuda import nvrtc
    from .backends.cuda.runtime import SOURCES

    try:
        ver = nvrtc.version()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "reason": _first_line(exc)}
    out = {"version": f"{ver[0]}.{ver[1]}", "library": nvrtc.library_path(), "archs": list(archs)}
    try:
        worst = {"registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0}
        jobs = [(src, arch) for arch in archs for src in SOURCES]
        # a program per thread on the cores this process may use (NVRTC compiles separate programs concurrently,
        # and ctypes lets go of the GIL): a first doctor on a many-core GPU node takes seconds, not 15 compiles
        # of ~2 s one after another
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), _device.default_threads()))) as pool:
            for res in pool.map(lambda job: nvrtc.compile_kernel(*job, "-Xptxas=-v"), jobs):
                for stats in nvrtc.ptxas_report(res.log).values():
                    worst = {k: max(worst[k], stats[k]) for k in worst}
    except Exception as exc:  # noqa: BLE001
        out.update(ok=False, reason=_first_line(exc))
        return out
    spills = worst["stack"] + worst["spill_stores"] + worst["spill_loads"]
    out.update(ok=spills == 0, max_registers=worst["registers"],
               reason=f"every kernel compiled for sm_{'/sm_'.join(map(str, archs))}"
               + ("" if spills == 0 else f", but with {spills} bytes of stack or spills"))
    return out


def _scan_check(be, dev: torch.device) -> str:
    n, B, H = SCAN_SHAPE
    gen = torch.Generator().manual_seed(0)
    msgs = []
    for dtype, tol in SCAN_TOL.items():
        g = torch.randn(B, H, generator=gen, dtype=torch.float64)
        J = torch.randn(n, B, H, H, generator=gen, dtype=torch.float64) / H**0.5
        ref = linear_scan(g, J)
        got = be.scan(g.to(dev, dtype), J.to(dev, dtype).contiguous()).double().cpu()
        err = float((got - ref).abs().max() / ref.abs().max())
        if not err <= tol:
            raise AssertionError(f"{dtype} scan of n={n} differs from the sequential scan: "
                                 f"rel. err {err:.2e} > {tol:g}")
        msgs.append(f"{str(dtype).split('.')[-1]} {err:.1e}")
    return "scan vs sequential " + ", ".join(msgs)


# every backend but 'auto'; 'cpu' is the CPU fast path (bppsa.backends.cpu)
CHECKED = tuple(name for name in _backends.BACKENDS if name != "auto")


def check_backend(name: str, dev: torch.device) -> dict:
    from .verify import verify

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            be = _backends.get_backend(name, dev)
    except Exception as exc:  # noqa: BLE001 - the reason is what the user needs
        why = str(exc)
        if name.startswith("cupy"):
            c = cupy_info()
            why += (f"; CuPy {c['version']} is installed" if c["installed"]
                    else f"; CuPy is not installed ({c['reason']})")
        return {"ok": False, "reason": why}
    if be.name != name:  # e.g. the CPU fast path falling back to the torch backend
        return {"ok": False, "reason": f"backend '{name}' is unavailable here; '{be.name}' would run instead"}
    try:
        parts = [_scan_check(be, dev)]
        for case in VERIFY:
            r = verify(backend=name, device=str(dev), **case)
            if not r["ok"]:
                why = f"verify {case} failed: max_rel_err {r['max_rel_err']:.2e} > {r['tolerance']:g}"
                return {"ok": False, "reason": why}
            parts.append(f"verify {case['model']} {case['dtype']} {r['max_rel_err']:.1e}")
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "reason": _first_line(exc)}
    return {"ok": True, "reason": "; ".join(parts)}


# the headline shapes whose CPU plans doctor reports: the RNN at T = 1000 and the GRU on set L, B = 16, fp32
HEADLINE_PLANS = (("rnn", 1000, 16, 20, 1), ("gru", 1034, 16, 20, 12))


def cpu_kernel_info() -> dict:
    """Whether the CPU fast path's compiled kernel (:mod:`bppsa.backends.cpu.native`) builds and runs here; its
    build target, and the plans (:mod:`bppsa.backends.cpu.plan`) of the headline shapes' training steps."""
    from .backends.cpu import chain, native, plan, pool

    reason = native.unavailable_reason()
    info = {"ok": reason is None, "reason": reason or f"built with {native.compiler_name()} into {native.cache_dir()}"}
    tg = native.target()
    if tg:
        info["target"] = {k: tg[k] for k in ("isa", "simd", "vector_bytes", "registers")}
        info["lanes"] = {str(dt).removeprefix("torch."): native.lane_width("rnn", dt)
                         for dt in (torch.float32, torch.float64)}
    if reason is None:
        from . import scan as _scan

        threads = pool.threads()
        info["plans"] = {}
        for kind, n, B, H, I in HEADLINE_PLANS:
            L = _scan.tree_levels(n + 1, None)
            p = plan.choose(kind, n, B, H, I, torch.float32, L, "auto", True, threads,
                            lambda k=kind, n=n, B=B, H=H, I=I: chain.synthetic(k, n, B, H, I, torch.float32))
            info["plans"][f"{kind} T={n} B={B} fp32"] = p.describe()
        info["plan_mode"] = plan.mode()
    from . import process

    info["openmp"] = process.openmp_report()
    return info


def diagnose(device: str = "auto") -> dict:
    try:
        dev = _device.resolve(device)
    except RuntimeError as exc:  # e.g. --device cuda on a machine where torch sees no GPU
        dev, unusable = None, str(exc)
    rep: dict = {
        "device": str(dev) if dev is not None else device,
        "device_slug": _device.slug(dev) if dev is not None else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "driver": driver_version(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cupy": cupy_info(),
        "cpu_kernel": cpu_kernel_info(),
    }
    archs = NVRTC_ARCHS
    if dev is not None and dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        cc = props.major * 10 + props.minor
        rep["gpu"] = {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "shared_memory_per_block": getattr(props, "shared_memory_per_block", None),
                      "shared_memory_per_block_optin": getattr(props, "shared_memory_per_block_optin", None)}
        archs = (cc,)
    rep["nvrtc"] = nvrtc_compile(archs)
    if dev is None:
        rep["backends"] = {name: {"ok": False, "reason": unusable} for name in CHECKED}
    else:
        # the CPU fast path runs on CPU tensors whatever device the others are checked on
        rep["backends"] = {name: check_backend(name, torch.device("cpu") if name == "cpu" else dev)
                           for name in CHECKED}
    rep["fixes"] = fixes(rep)
    rep["ok"] = any(b["ok"] for b in rep["backends"].values())
    return rep


def fixes(rep: dict) -> list[str]:
    """What to do next, from the findings; empty when everything this machine should run runs."""
    out = []
    gpu_seen = rep["driver"] is not None
    if gpu_seen and not rep["cuda_available"]:
        build = f"CUDA {rep['torch_cuda']} build" if rep["torch_cuda"] else "CPU-only build"
        out.append(f"nvidia-smi sees a GPU (driver {rep['driver']}) but torch {rep['torch']} ({build}) cannot use it: "
                   f"rerun `bash scripts/install.sh`, which picks the torch build this driver supports")
    if rep["cuda_available"]:
        cupy = rep["cupy"]
        if not cupy["installed"]:
            out.append("CuPy is not installed: `bash scripts/install.sh` (or pip install -e '.[cuda"
                       f"{(rep['torch_cuda'] or '13').split('.')[0]}]') for the CuPy kernels")
        elif not rep["backends"]["cupy"]["ok"]:
            out.append(f"the CuPy backend fails: {rep['backends']['cupy']['reason']}")
        elif not rep["backends"].get("cupy-factored", {"ok": True})["ok"]:
            out.append(f"the factored CuPy backend fails: {rep['backends']['cupy-factored']['reason']}")
        rt, tc = cupy.get("cuda_runtime"), rep["torch_cuda"]
        if rt and tc and rt.split(".")[0] != tc.split(".")[0]:
            out.append(f"CuPy is built for CUDA {rt} but torch for CUDA {tc}: `bash scripts/install.sh` replaces it")
    if not rep["backends"]["torch"]["ok"]:
        out.append(f"the torch backend fails on {rep['device']}: {rep['backends']['torch']['reason']}")
    if not rep["cpu_kernel"]["ok"]:
        out.append(f"the CPU fast path's compiled kernel is unavailable ({rep['cpu_kernel']['reason']}); the cpu "
                   "backend runs its slower numpy path: install a C compiler (e.g. `apt-get install gcc`) "
                   "or set CC, and make $BPPSA_CACHE_DIR (default ~/.cache/bppsa) writable")
    if not rep["nvrtc"].get("ok", False) and (rep["cuda_available"] or "library" in rep["nvrtc"]):
        out.append(f"NVRTC: {rep['nvrtc']['reason']}")
    return out


def render(rep: dict) -> str:
    c = rep["cupy"]
    lines = [
        f"device        {rep['device']} ({rep['device_slug'] or 'unusable'})",
        f"driver        {rep['driver'] or 'none (nvidia-smi absent or sees no GPU)'}",
        f"torch         {rep['torch']}, CUDA build {rep['torch_cuda'] or 'none (CPU)'}, "
        f"GPU usable: {rep['cuda_available']}",
        f"cuDNN         {rep['cudnn'] or 'none'}",
    ]
    if "gpu" in rep:
        g = rep["gpu"]
        sm = g["compute_capability"].replace(".", "")
        lines.append(f"GPU           {g['name']}, sm_{sm}, {g['memory_gib']} GiB, "
                     f"shared memory per block {g['shared_memory_per_block']} B "
                     f"(opt-in {g['shared_memory_per_block_optin']} B)")
    if c["installed"]:
        nv = (f"NVRTC {c['nvrtc']} {c.get('nvrtc_library') or ''}".rstrip() if c.get("nvrtc")
              else f"no NVRTC: {c.get('nvrtc_reason')}")
        lines.append(f"CuPy          {c['version']} (CUDA runtime {c.get('cuda_runtime') or '?'}), {nv}")
    else:
        lines.append(f"CuPy          not installed ({c['reason']})")
    n = rep["nvrtc"]
    lines.append(f"NVRTC wheel   {'NVRTC ' + n['version'] + ': ' if 'version' in n else ''}"
                 f"{'ok' if n.get('ok') else 'FAIL'}: {n['reason']}")
    k = rep["cpu_kernel"]
    lines.append(f"CPU kernel    {'ok' if k['ok'] else 'FAIL'}: {k['reason']}")
    if "target" in k:
        t = k["target"]
        lanes = ", ".join(f"{n} {d}" for d, n in k["lanes"].items())
        lines.append(f"CPU target    BPPSA_CPU_ISA={t['isa']}: {t['simd']}, {t['vector_bytes']}-byte vectors, "
                     f"{t['registers']} registers; lanes per slice: {lanes}")
    for shape, desc in k.get("plans", {}).items():
        lines.append(f"CPU plan      {shape}: {desc} [BPPSA_PLAN={k['plan_mode']}]")
    o = k.get("openmp")
    if o:
        lines.append(f"OpenMP        {o['runtime'] or 'none loaded'}: {o['variable']}={o['value']} ({o['set_by']})"
                     + ("" if o["effective"] or not o["variable"] else f"; NOT in effect: {o['note']}"))
    for name, b in rep["backends"].items():
        lines.append(f"backend {name:<14}{'ok  ' if b['ok'] else 'FAIL'}  {b['reason']}")
    lines.append("to fix:" if rep["fixes"] else "nothing to fix")
    lines += [f"  - {f}" for f in rep["fixes"]]
    return "\n".join(lines)
