"""The kernels as a GPU run compiles them, checked without a GPU: NVRTC from the nvidia-cuda-nvrtc
wheel (the `test` extra) with CuPy's effective options, for sm_90, sm_80 and sm_75.

* no warnings, no register spills, no stack frame;
* the fp32 Jacobian fill has no flush-to-zero instruction, although CuPy appends -ftz=true;
* every kernel's PTX parameter list matches what the launchers pass (count and 64-bit width);
* the factored kernels' registers, spills, shared memory and occupancy against a checked-in record
  (``tests/data/ptxas_factored.json``).

In CI (CI=true) a missing NVRTC fails these tests instead of skipping them.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cuda_emulator import KERNEL_NAMES, kernels_for

from bppsa.backends import cuda
from bppsa.backends.cuda import nvrtc, runtime

ARCHS = (90, 80, 75)
KERNELS = KERNEL_NAMES  # every extern "C" kernel of each source (factored_up.cu: at H = 20)


@pytest.fixture(scope="module")
def nv():
    try:
        return nvrtc.version()
    except (nvrtc.NvrtcUnavailable, OSError) as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must compile the kernels with NVRTC, but: {exc}")
        pytest.skip(f"NVRTC unavailable: {exc}")


@functools.cache
def _compiled(source: str, arch: int):
    return nvrtc.compile_kernel(source, arch, "-Xptxas=-v")


def _diagnostics(log: str) -> list[str]:
    """Log lines that are not ptxas's resource report: warnings, remarks, errors."""
    return [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("ptxas")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", runtime.SOURCES)
def test_compiles_clean_with_cupys_options(nv, source, arch):
    r = _compiled(source, arch)
    assert not _diagnostics(r.log), r.log
    report = nvrtc.ptxas_report(r.log)
    assert sorted(report) == sorted(kernels_for(source, runtime.reference_constants(source)))
    for name, stats in report.items():
        assert stats["registers"] > 0, (name, stats)
        assert stats["stack"] == 0 and stats["spill_stores"] == 0 and stats["spill_loads"] == 0, (name, arch, stats)
        assert name.encode() in r.cubin  # extern "C": the unmangled names CuPy's get_function looks up


def _entry_bodies(ptx: bytes) -> dict[str, str]:
    text = ptx.decode()
    starts = [(m.group(1), m.start()) for m in re.finditer(r"\.visible\s+\.entry\s+(\w+)", text)]
    ends = [a for _, a in starts[1:]] + [len(text)]
    return {name: text[a:end] for (name, a), end in zip(starts, ends)}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_fill_keeps_subnormals_under_cupys_ftz(nv, arch):
    bodies = _entry_bodies(_compiled("rnn_jacobians.cu", arch).ptx)
    for name in ("bppsa_rnn_jacobians_paper_f32", "bppsa_rnn_jacobians_fused_f32"):
        body = bodies[name]
        assert re.search(r"\bmul\.rn\.f32", body) and re.search(r"\bsub\.rn\.f32", body), name
        flushing = [line for line in body.splitlines() if ".ftz" in line]
        assert not flushing, f"{name} flushes subnormals: {flushing}"


def test_cupys_ftz_does_flush_plain_fp32_arithmetic(nv):
    # the control: the same options turn a plain __fmul_rn into its flushing form, so the check above can fail
    src = 'extern "C" __global__ void k(float* o, const float* a) { o[0] = __fmul_rn(a[0], a[1]); }'
    r = nvrtc.compile_source(src, nvrtc.cupy_options(90))
    assert b"mul.rn.ftz.f32" in r.ptx


def test_the_compile_checks_can_fail(nv):
    src = r'''
__device__ __noinline__ float pick(const float* a, int i) { return a[i]; }
extern "C" __global__ void k(float* o, int i) {
  int unused;
  float a[64];  // passed by address to a call: it must live in a stack frame
  for (int j = 0; j < 64; ++j) a[j] = o[j] * j;
  o[0] = pick(a, i);
}'''
    r = nvrtc.compile_source(src, nvrtc.cupy_options(90) + ("-Xptxas=-v",))
    assert any("warning" in ln for ln in _diagnostics(r.log))
    assert nvrtc.ptxas_report(r.log)["k"]["stack"] > 0
    assert nvrtc.ptx_entries(r.ptx)["k"] == ["u64", "u32"]
    with pytest.raises(nvrtc.CompileError, match="k.cu"):
        nvrtc.compile_source("this is not CUDA", nvrtc.cupy_options(90), "k.cu")


# -- what the launchers pass -----------------------------------------------------------------------
def _recorded_launches(monkeypatch) -> list[tuple[str, tuple, int]]:
    """Run CupyBackend's scan and fill on CPU tensors with the CUDA calls replaced by a recorder."""
    calls = []

    class Fn:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            assert isinstance(stream, runtime.TorchStream) and stream.ptr == 0x7F00
            calls.append((self.name, args, shared_mem))

    monkeypatch.setattr(runtime, "import_cupy", lambda: SimpleNamespace(__version__="recorder"))
    monkeypatch.setattr(runtime, "kernel", lambda source, name, index, *consts: Fn(name))
    monkeypatch.setattr(runtime, "stream", lambda dev: runtime.TorchStream(0x7F00))
    t = torch.zeros(3)
    assert isinstance(runtime.pointer(t), np.uint64) and runtime.pointer(t) == t.data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        runtime.pointer(torch.zeros(3, 4).t())
    real = runtime.pointer  # still called: every operand the launchers pass must be contiguous
    monkeypatch.setattr(runtime, "pointer", lambda t: real(t) and np.uint64(0x7F0000001000))  # CPU stand-ins
    monkeypatch.setattr(runtime, "check_cuda", lambda dtype, *ts: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "smem_optin", lambda dev: 227 * 1024)
    monkeypatch.setattr(runtime, "_opted_in", {})
    be = cuda.CupyBackend()
    for dtype in (torch.float32, torch.float64):
        g, J = torch.zeros(2, 5, dtype=dtype), torch.zeros(20, 2, 5, 5, dtype=dtype)
        be.scan(g, J)
        be.scan(g, J, 1)  # with the middle scan
        for layout in ("paper", "fused"):
            be.rnn_jacobians_t(torch.zeros(3, 2, 5, dtype=dtype), torch.zeros(5, 5, dtype=dtype), layout)
    fb = cuda.CupyFactoredBackend()
    for dtype in (torch.float32, torch.float64):
        g, x = torch.zeros(2, 5, dtype=dtype), torch.zeros(40, 2, 3, dtype=dtype)
        rnn = fb.rnn_jacobians_t(torch.zeros(40, 2, 5, dtype=dtype), torch.zeros(5, 5, dtype=dtype), "fused", x)
        gru = fb.gru_jacobians_t(x, torch.zeros(40, 2, 5, dtype=dtype), torch.nn.GRU(3, 5).to(dtype))
        c = torch.zeros(40, 2, 5, dtype=dtype)
        for chain in (rnn, gru):  # 40 steps in chunks of 4: up, middle, down; the scan and the gradients
            fb.scan(g, chain)
            fb.cell_grads(g, chain, None, None)
            fb.affine_scan(g, chain, c)  # the per-step gradients: the offsets, the middle kernel, the down kernel
            fb.cell_grads(g, chain, None, None, c=c)
        # an H too large for the register up kernel (plan.up_columns) and the warp down kernel (H > 32): factored.cu's
        # shared-memory up and down kernels
        H = 41 if dtype == torch.float32 else 33
        wide = fb.rnn_jacobians_t(torch.zeros(40, 2, H, dtype=dtype), torch.zeros(H, H, dtype=dtype), "fused", x)
        gwide = fb.gru_jacobians_t(x, torch.zeros(40, 2, H, dtype=dtype), torch.nn.GRU(3, H).to(dtype))
        for chain in (wide, gwide):
            fb.scan(torch.zeros(2, H, dtype=dtype), chain)
    return calls


def _width(arg) -> int:
    if isinstance(arg, np.uint64):  # a device pointer (runtime.pointer)
        return arg.itemsize
    assert isinstance(arg, np.int64), f"launch argument {arg!r} is a {type(arg).__name__}, not an explicit np.int64"
    return arg.itemsize


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_parameters_match_the_launchers(nv, arch, monkeypatch):
    entries = {}
    for source in runtime.SOURCES:
        entries.update(nvrtc.ptx_entries(_compiled(source, arch).ptx))
    # the recorder's chains (H = 5, I = 3) take the GRU's fp64 warp down kernel, which H = 20, I = 12 leaves out
    entries.update(nvrtc.ptx_entries(nvrtc.compile_kernel("factored_warp.cu", arch,
                                                          consts=cuda.plan.warp_constants(5, 3)).ptx))
    calls = _recorded_launches(monkeypatch)
    assert {name for name, _, _ in calls} == set(entries), "every kernel launched, and only those"
    for name, args, _smem in calls:
        params = entries[name]
        assert len(args) == len(params), (name, len(args), params)
        assert [_width(a) for a in args] == [int(p[1:]) // 8 for p in params], (name, params)
    # dynamic shared memory in bytes of the launch's dtype (dtype.itemsize, not a fixed size)
    scans = [(n, s) for n, _, s in calls if "sweep" in n or "middle" in n]
    assert {s % 8 for n, s in scans if n.endswith("f64")} == {0} and any(s % 8 for n, s in scans if n.endswith("f32"))


def test_options_mirror_what_cupy_passes():
    """Where CuPy is installed (GPU machines): our copy of its appended options is what it really
    appends.  Its compiler is called with the device lookup replaced, so no GPU is needed."""
    compiler = pytest.importorskip("cupy.cuda.compiler", reason="CuPy not installed")
    needed = ("_NVRTCProgram", "_compile_module_with_cache", "_get_arch_for_options_for_nvrtc")
    if not all(hasattr(compiler, n) for n in needed):
        pytest.skip(f"this CuPy's compiler internals differ ({needed})")
    seen = []

    class Stop(Exception):
        pass

    orig = compiler._NVRTCProgram.compile

    def spy(self, options=(), log_stream=None):
        out = orig(self, options, log_stream)
        if "bppsa" in self.src:
            seen.append(tuple(options))
            raise Stop
        return out

    patched = contextlib.ExitStack()
    mp = patched.enter_context(pytest.MonkeyPatch.context())
    mp.setattr(compiler._NVRTCProgram, "compile", spy)
    mp.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    mp.setenv("CUPY_CACHE_IN_MEMORY", "1")
    with patched:
        try:
            compiler._compile_module_with_cache((runtime.KERNEL_DIR / "rnn_jacobians.cu").read_text(),
                                                runtime.NVRTC_OPTIONS, arch="90", backend="nvrtc")
        except Stop:
            pass
    assert seen == [nvrtc.cupy_options(90)]


# -- the factored kernels: registers, spills, shared memory and occupancy against a checked-in record -------------
PTXAS_RECORD = Path(__file__).parent / "data" / "ptxas_factored.json"
REGISTER_GROWTH = 1.10  # registers may grow this much before the record must be updated (and occupancy rechecked)
# per SM: threads, resident blocks, 32-bit registers, shared memory (the largest carve-out), shared memory the
# runtime reserves per block (CUDA occupancy calculator / programming guide, compute capabilities 7.5, 8.0, 9.0)
SM_LIMITS = {75: (1024, 16, 65536, 64 * 1024, 0), 80: (2048, 32, 65536, 164 * 1024, 1024),
             90: (2048, 32, 65536, 228 * 1024, 1024)}


def occupancy(arch: int, registers: int, block: int, smem_bytes: int) -> dict[str, int]:
    """Resident blocks and threads per SM of a kernel: registers are allocated per warp in units of 256 from each
    of the 4 SM sub-partitions' 16384, shared memory per block plus the runtime's reserve."""
    threads, blocks, regs, smem, reserve = SM_LIMITS[arch]
    warps = -(-block // 32)
    warp_regs = -(-registers * 32 // 256) * 256
    by_regs = 4 * (regs // 4 // warp_regs) // warps
    by_smem = smem // (smem_bytes + reserve) if smem_bytes + reserve else blocks
    n = min(blocks, threads // block, by_regs, by_smem)
    return {"blocks_per_sm": n, "threads_per_sm": n * block, "limited_by_registers": int(by_regs == n)}


FACTORED_SOURCES = ("factored.cu", "factored_up.cu", "factored_warp.cu")


def _factored_launches() -> dict[str, tuple[int, int]]:
    """Kernel base name -> (threads, dynamic shared memory in elements per dtype suffix) of the default plan at the
    paper's sizes: T = 30000, B = 16, H = 20, the RNN with I = 1 and the GRU with the IRMAS MFCCs' I = 12, training
    step; the shared-memory up kernels (which the plan takes only above H = 40 in fp32, 20 in fp64) as they would
    launch at H = 20."""
    from bppsa.backends.cuda import cost_model, plan
    from bppsa.models import SPECS

    out = {}
    for kind in ("rnn", "gru"):
        H, I = SPECS[kind].hidden, SPECS[kind].input_size
        for itemsize, suffix in ((4, "f32"), (8, "f64")):
            _, launches = cost_model.factored_plan(kind, 30000, 16, H, I, itemsize=itemsize)
            out.update({f"{x.kernel}_{suffix}": (x.block, x.smem_elems) for x in launches
                        if x.kernel.startswith("bppsa_factored_")})
            _, affine = cost_model.factored_plan(kind, 30000, 16, H, I, itemsize=itemsize, affine=True)
            assert {x.kernel for x in affine} <= {x.kernel for x in launches}  # the same kernels, the middle's mode 2
            smem_up, smem_down = plan.factored_smem(kind, H, I, True)
            out[f"bppsa_factored_up_smem_{kind}_{suffix}"] = (plan.up_threads(H), smem_up)
            # factored.cu's down kernel, which the plan takes where the warp kernel's registers would not hold a pair
            out.setdefault(f"bppsa_factored_down_{kind}_{suffix}", (plan.down_threads(H, True), smem_down))
            if kind == "gru":  # the GRU's factors from the forward's states
                gf = plan.gru_factors_launch(30000, 16, H, I)
                out[f"{gf.kernel}_{suffix}"] = (gf.block, gf.smem_elems)
    return out


def _factored_ptxas() -> dict:
    launches = _factored_launches()
    rec: dict = {"nvrtc": ".".join(map(str, nvrtc.version())), "plan": "T=30000 B=16 H=20, rnn I=1, gru I=12"}
    for arch in ARCHS:
        report = {k: v for src in FACTORED_SOURCES for k, v in nvrtc.ptxas_report(_compiled(src, arch).log).items()}
        per = {}
        for name, stats in sorted(report.items()):
            block, elems = launches[name]
            smem = elems * (8 if name.endswith("f64") else 4) + stats["smem"]
            per[name] = {"registers": stats["registers"], "spill_stores": stats["spill_stores"],
                         "spill_loads": stats["spill_loads"], "static_smem": stats["smem"], "block": block,
                         "smem_bytes": smem, **occupancy(arch, stats["registers"], block, smem)}
        rec[f"sm_{arch}"] = per
    return rec


def test_factored_kernels_ptxas_record(nv):
    """Zero spills, registers within REGISTER_GROWTH of tests/data/ptxas_factored.json, and at least the recorded
    occupancy of the default plan.  BPPSA_UPDATE_PTXAS_RECORD=1 rewrites the record (review the diff)."""
    got = _factored_ptxas()
    if os.environ.get("BPPSA_UPDATE_PTXAS_RECORD") == "1":
        PTXAS_RECORD.parent.mkdir(exist_ok=True)
        PTXAS_RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(PTXAS_RECORD.read_text())
    for arch in ARCHS:
        key = f"sm_{arch}"
        assert sorted(got[key]) == sorted(want[key]) == sorted(
            k for src in FACTORED_SOURCES for k in kernels_for(src, runtime.reference_constants(src)))
        for name, g in got[key].items():
            w = want[key][name]
            assert g["spill_stores"] == g["spill_loads"] == 0, (arch, name, g)
            assert g["registers"] <= w["registers"] * REGISTER_GROWTH, (
                f"{name} on sm_{arch}: {g['registers']} registers, recorded {w['registers']}; update the record")
            assert g["static_smem"] == w["static_smem"] == 0, (arch, name)  # shared memory is dynamic, per plan
            assert (g["block"], g["smem_bytes"]) == (w["block"], w["smem_bytes"]), (arch, name)
            assert g["blocks_per_sm"] >= w["blocks_per_sm"] >= 1, (arch, name, g, w)


def test_occupancy_model():
    # 256 threads, 32 registers, no shared memory: 8 blocks (2048 threads) on sm_90, 4 on sm_75 (1024 threads)
    assert occupancy(90, 32, 256, 0)["blocks_per_sm"] == 8 and occupancy(75, 32, 256, 0)["blocks_per_sm"] == 4
    # 128 registers x 256 threads = 32768: two blocks' registers per SM
    assert occupancy(90, 128, 256, 0) == {"blocks_per_sm": 2, "threads_per_sm": 512, "limited_by_registers": 1}
    # 100 KiB of shared memory: two blocks on sm_90 (228 KiB), one on sm_80 (164 KiB)
    assert occupancy(90, 32, 128, 100 * 1024)["blocks_per_sm"] == 2
    assert occupancy(80, 32, 128, 100 * 1024)["blocks_per_sm"] == 1


def test_a_compile_is_cached_and_a_damaged_entry_compiled_again(nv, tmp_path, monkeypatch):
    """The same source, options and NVRTC give the cached result without compiling; an entry whose cubin was
    cut short, or whose index is garbage, is compiled again."""
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path))
    src, opts = "extern \"C\" __global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }", ("-arch=sm_80",)
    calls = []
    real = nvrtc._compile
    monkeypatch.setattr(nvrtc, "_compile", lambda *a: calls.append(a) or real(*a))
    first = nvrtc.compile_source(src, opts, "k.cu")
    assert nvrtc.compile_source(src, opts, "k.cu") == first and len(calls) == 1
    assert nvrtc.compile_source(src + " ", opts, "k.cu").cubin and len(calls) == 2  # another source, another key
    (cubin,) = (tmp_path / "nvrtc").glob(f"{nvrtc._cache_key(src, opts, 'k.cu')}.cubin")
    cubin.write_bytes(cubin.read_bytes()[:100])
    assert nvrtc.compile_source(src, opts, "k.cu") == first and len(calls) == 3
    cubin.with_suffix(".json").write_text("{not json")
    assert nvrtc.compile_source(src, opts, "k.cu") == first and len(calls) == 4
    assert nvrtc.compile_source(src, opts, "k.cu") == first and len(calls) == 4
