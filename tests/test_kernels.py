"""The CUDA path: kernel sources, launch geometry, and (on a GPU) the CuPy backend against torch.

Three layers, so that as much as possible is checked on a machine without a GPU:

* every ``.cu`` file compiles with ``nvcc`` for the oldest and the newest architecture we target
  (and with NVRTC and CuPy's own options: ``tests/test_nvrtc.py``);
* the launch plan (:func:`bppsa.backends.cuda.plan.scan_plan`) reproduces the tree of :func:`bppsa.scan.levels`,
  and the *actual kernel sources*, compiled as host C++ with a thin shim (blocks run one after the
  other, the threads of a block as real threads meeting at a ``std::barrier``), reproduce
  :func:`bppsa.scan.blelloch_scan` and ``rnn_jacobians_t`` when driven by that plan (the emulator:
  ``tests/cuda_emulator.py``);
* ``@pytest.mark.gpu``: the real CuPy backend against the torch twins, and a whole RNN training
  step against autograd.
"""
from __future__ import annotations

import contextlib
import copy
import shutil
import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cuda_emulator import (
    KERNEL_NAMES,
    Buf,
    backend_or_skip,
    build_emulator,
    emulated_launch,
    emulated_scan,
    kernels_for,
)

from bppsa.backends.cuda import plan, runtime
from bppsa.jacobians.recurrent import rnn_jacobians_t
from bppsa.precision import ieee_fp32
from bppsa.scan import blelloch_scan, levels, middle_ends, reference_scan


# ---------------------------------------------------------------------------------------------
# 1. nvcc compiles every source for sm_70 (or the oldest arch this nvcc has) and sm_90
# ---------------------------------------------------------------------------------------------
def _compile_targets():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="nvcc not on PATH"), id="no-nvcc")]
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout.split()
    supported = sorted({int(a.split("_")[1]) for a in listed if a.startswith("compute_")})
    if not supported:
        skip = pytest.mark.skip(reason="nvcc --list-gpu-arch listed nothing")
        return [pytest.param(None, None, marks=skip, id="no-archs")]
    out = []
    for want in (70, 90):
        if want in supported:
            out.append((want, f"sm{want}"))
        elif want < supported[0]:
            # CUDA 13 dropped Volta; the oldest arch it has stands in for it.
            out.append((supported[0], f"sm{want}-unsupported-by-this-nvcc-using-sm{supported[0]}"))
        else:
            skip = pytest.mark.skip(reason=f"sm_{want} not supported by this nvcc")
            out.append(pytest.param(None, None, marks=skip, id=f"sm{want}-unsupported"))
    params = []
    for src in runtime.SOURCES:
        for item in out:
            if isinstance(item, tuple):
                params.append(pytest.param(src, item[0], id=f"{src}-{item[1]}"))
            else:
                params.append(pytest.param(src, None, marks=item.marks, id=f"{src}-{item.id}"))
    return params


@pytest.mark.matrix  # every kernel source for every arch: a build matrix
@pytest.mark.parametrize("source,arch", _compile_targets())
def test_nvcc_compiles(source, arch, tmp_path):
    cubin = tmp_path / "k.cubin"
    proc = subprocess.run(
        ["nvcc", "-std=c++17", f"-arch=sm_{arch}", "-cubin", "-Werror", "all-warnings",
         *runtime.define_options(runtime.reference_constants(source)),
         "-o", str(cubin), str(runtime.KERNEL_DIR / source)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    blob = cubin.read_bytes()
    for name in kernels_for(source, runtime.reference_constants(source)):  # extern "C": what CuPy looks up
        assert name.encode() in blob, f"{name} missing from the {source} cubin"


def test_sources_ship_with_the_package():
    for src in runtime.SOURCES:
        assert (runtime.KERNEL_DIR / src).is_file()


def test_plan_uses_only_kernels_that_exist():
    used = {launch.kernel for N in range(1, 40) for L_m in (None, 0, 1, 2)
            for launch in plan.scan_plan(N, 2, 3, L_m)[1]}
    used |= {plan.rnn_jacobians_launch(3, 2, 4, lay).kernel for lay in ("paper", "fused")}
    defined = {n.rsplit("_", 1)[0] for names in KERNEL_NAMES.values() for n in names}
    assert used <= defined


# ---------------------------------------------------------------------------------------------
# 2. launch geometry, in pure Python
# ---------------------------------------------------------------------------------------------
def _block_pair(ints, block):
    """The (b, l, r) a sweep block works on, by the kernels' own formula."""
    N, B, H, first_l, half, step, d = ints
    pair, b = divmod(block, B)
    l = first_l + pair * step
    return b, l, min(l + half, N - 1)


@pytest.mark.parametrize("L_m", [None, 0, 1, 2, 3])
def test_plan_reproduces_the_tree(L_m):
    for N in list(range(1, 300)) + [1000, 1025, 2001, 60001]:
        B = 1 + N % 4
        L, launches = plan.scan_plan(N, B, 5, L_m)
        lv = levels(N)
        assert L == (len(lv) if L_m is None else min(L_m, len(lv)))
        ups = [x for x in launches if x.kernel == "bppsa_up_sweep"]
        downs = [x for x in launches if x.kernel == "bppsa_down_sweep"]
        mids = [x for x in launches if x.kernel == "bppsa_middle_scan"]
        assert list(launches) == ups + mids + downs  # up-sweep, middle, down-sweep, in that order
        assert [x.ints[-1] for x in ups] == list(range(L))
        assert [x.ints[-1] for x in downs] == list(reversed(range(L)))
        for x in ups + downs:
            want = lv[x.ints[-1]].pairs()
            got = [_block_pair(x.ints, blk) for blk in range(x.grid)]
            assert sorted(got) == sorted((b, l, r) for b in range(B) for (l, r) in want), (N, x)
            # the spine pair is pair 0 of every level
            assert _block_pair(x.ints, 0)[1:] == want[0] == (lv[x.ints[-1]].first_l, want[0][1])
        size = 1 << L
        ends = middle_ends(N, L)
        if len(ends) >= 2:
            (mid,) = mids
            _, _, _, m_size, K, m_L, _ = mid.ints
            assert (m_size, K, m_L, mid.grid) == (size, len(ends), L, B)
            assert [min((k + 1) * m_size - 1, N - 1) for k in range(K)] == ends
        else:
            assert not mids


def test_block_threads_and_shared_memory():
    for H in range(1, 80):
        t = plan.block_threads(H)
        assert t % 32 == 0 and 32 <= t <= plan.MAX_THREADS
        assert t >= min(H * H, plan.MAX_THREADS)
    # fp64 64x64 needs two 32 KiB operands: over the 48 KiB static limit, within Turing's 64 KiB opt-in
    assert plan.max_hidden(torch.float64, 64 * 1024) == 64
    assert plan.max_hidden(torch.float32, 64 * 1024) == 90
    assert plan.max_hidden(torch.float64, 48 * 1024) == 55


# ---------------------------------------------------------------------------------------------
# 3. the kernel sources themselves, emulated on the CPU
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emu():
    return build_emulator()


@pytest.mark.parametrize(
    "n,B,H,L_m",
    [(1, 1, 1, None), (2, 2, 3, None), (3, 1, 2, None), (4, 3, 3, None), (5, 2, 7, None), (8, 1, 3, None),
     (9, 2, 3, None), (16, 1, 4, None), (19, 2, 5, None), (33, 1, 3, None), (6, 2, 17, None),
     (19, 2, 3, 0), (19, 1, 4, 1), (21, 2, 3, 2), (33, 1, 2, 3), (7, 1, 3, 2),
     # L_m = ceil(log2 N) - 1 with N not a power of two: the middle's first block end is clipped
     (9, 2, 3, 3), (19, 1, 3, 4)],
)
def test_emulated_scan_matches_torch(emu, n, B, H, L_m):
    gen = torch.Generator().manual_seed(1000 * n + 10 * B + H)
    g = torch.randn(B, H, generator=gen, dtype=torch.float64)
    J = torch.randn(n, B, H, H, generator=gen, dtype=torch.float64) / H**0.5
    ref = blelloch_scan(g, J, L_m)
    out, J_after = emulated_scan(emu, g.numpy(), J.numpy(), L_m)
    assert not np.isnan(out).any(), "a prefix was never written (or read unstaged shared memory)"
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-12, atol=1e-12)
    # the workspace holds the textbook in-place up-sweep's partial products, position by position
    _, ups = reference_scan(g, J, L_m, matmat=torch.matmul, matvec=_batched_mv)
    np.testing.assert_allclose(J_after, torch.stack(ups).numpy(), rtol=1e-12, atol=1e-12)


def _batched_mv(a, v):
    return torch.matmul(a, v.unsqueeze(-1)).squeeze(-1)


def test_emulated_scan_float32(emu):
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(3, 5, generator=gen)
    J = torch.randn(13, 3, 5, 5, generator=gen) / 5**0.5
    ref = blelloch_scan(g.double(), J.double())
    out, _ = emulated_scan(emu, g.numpy(), J.numpy(), None)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["paper", "fused"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T,B,H", [(1, 1, 1), (3, 2, 4), (5, 3, 7)])
def test_emulated_rnn_jacobians_bit_identical(emu, layout, dtype, T, B, H):
    gen = torch.Generator().manual_seed(T * 100 + B * 10 + H)
    tdt = torch.float32 if dtype == np.float32 else torch.float64
    h = torch.tanh(torch.randn(T, B, H, generator=gen, dtype=tdt))
    W = torch.randn(H, H, generator=gen, dtype=tdt)
    ref = rnn_jacobians_t(h, W, layout).numpy()
    launch = plan.rnn_jacobians_launch(T, B, H, layout)
    out = Buf(np.full(ref.shape, np.nan, dtype=dtype))
    emulated_launch(emu, launch, dtype, [Buf(h.numpy()), Buf(W.numpy()), out])
    np.testing.assert_array_equal(out.value(), ref)


def test_emulated_grid_stride_fill(emu, monkeypatch):
    # Force fewer blocks than elements so every thread takes several grid-stride steps.
    monkeypatch.setattr(plan, "FILL_MAX_BLOCKS", 2)
    T, B, H = 4, 3, 6
    h = torch.tanh(torch.randn(T, B, H, dtype=torch.float64))
    W = torch.randn(H, H, dtype=torch.float64)
    launch = plan.rnn_jacobians_launch(T, B, H, "paper")
    assert launch.grid == 2 and launch.grid * launch.block < 2 * T * B * H * H
    out = Buf(np.full((2 * T, B, H, H), np.nan))
    emulated_launch(emu, launch, np.float64, [Buf(h.numpy()), Buf(W.numpy()), out])
    np.testing.assert_array_equal(out.value(), rnn_jacobians_t(h, W, "paper").numpy())


def _subnormal_case(dtype, T=4, B=2, H=5, seed=3):
    """h and W_hh whose fused products are subnormal in fp32: what a flush-to-zero fill gets wrong."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.tanh(torch.randn(T, B, H, generator=gen, dtype=dtype))
    W = torch.randn(H, H, generator=gen, dtype=dtype) * 1e-39  # 1e-39 < 1.18e-38: subnormal in fp32
    return h, W


@pytest.fixture
def keep_denormals():
    """CPU torch keeps subnormals here (the CLI's default flushes them, process-wide, in earlier tests)."""
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    flushing = bool((tiny * 1.0 == 0).item())
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(flushing)


def test_emulated_fill_keeps_subnormals(emu, keep_denormals):
    h, W = _subnormal_case(torch.float32)
    ref = rnn_jacobians_t(h, W, "fused")
    assert (ref != 0).any() and (ref.abs() < torch.finfo(torch.float32).tiny).all()  # the case is what it says
    launch = plan.rnn_jacobians_launch(*h.shape, "fused")
    out = Buf(np.full(ref.shape, np.nan, dtype=np.float32))
    emulated_launch(emu, launch, np.float32, [Buf(h.numpy()), Buf(W.numpy()), out])
    np.testing.assert_array_equal(out.value(), ref.numpy())


# ---------------------------------------------------------------------------------------------
# 4. without CuPy / CUDA
# ---------------------------------------------------------------------------------------------
def test_import_needs_no_cupy():
    code = "import sys; sys.modules['cupy'] = None; import bppsa.backends.cuda as k; print(k.CupyBackend.name)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "cupy", proc.stderr


def test_bench_membound_without_cuda_fails_clearly(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the command would run")
    from bppsa.cli import main

    rc = main(["bench-membound", "--seq-len", "10", "--out", str(tmp_path / "x.csv")])
    assert rc != 0
    assert not (tmp_path / "x.csv").exists()


def test_scan_bytes_counts_the_schedule():
    from bppsa.bench.membound import scan_bytes

    # N = 4 (n = 3), full scan, B = 1, H = 2, 8-byte elements.  Level 0: pairs (0,1) spine mv,
    # (2,3) mm; level 1: (1,3) spine mv.  Up: mv reads M+v writes v = 4+2+2; mm reads 2M writes M
    # = 12.  Down, level 1: spine copy 2+2; level 0: spine copy 2+2, pair (2,3) reads M+v, writes 2v = 4+2+4.
    up = (4 + 2 + 2) + 12 + (4 + 2 + 2)
    down = (2 + 2) + (2 + 2) + (4 + 2 + 4)
    assert scan_bytes(3, 1, 2, 8, None) == 8 * (up + down)


def test_ieee_fp32_turns_tf32_off_and_restores():
    b = torch.backends
    before = (b.cudnn.rnn.fp32_precision, b.cudnn.conv.fp32_precision, b.cuda.matmul.fp32_precision)
    with ieee_fp32():
        assert (b.cudnn.rnn.fp32_precision, b.cudnn.conv.fp32_precision, b.cuda.matmul.fp32_precision) == ("ieee",) * 3
    assert (b.cudnn.rnn.fp32_precision, b.cudnn.conv.fp32_precision, b.cuda.matmul.fp32_precision) == before
    assert b.cudnn.allow_tf32 in (True, False)  # the legacy reader still works: no mix of APIs left behind


@pytest.fixture
def fresh_probe():
    from bppsa import backends

    for cache in (backends._probe_cuda, runtime._module, runtime.kernel):
        cache.cache_clear()
    yield backends
    for cache in (backends._probe_cuda, runtime._module, runtime.kernel):
        cache.cache_clear()


def _fake_cupy(compile_error: Exception | None):
    class RawModule:
        def __init__(self, code, options):
            n = len(runtime.NVRTC_OPTIONS)  # then the source's compile-time constants, if any
            assert "bppsa" in code and tuple(options)[:n] == runtime.NVRTC_OPTIONS
            assert all(o.startswith("-DBPPSA_") for o in options[n:])
            if compile_error is not None:
                raise compile_error

        def get_function(self, name):
            return name

    cuda = SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    return SimpleNamespace(__version__="14.2.0", RawModule=RawModule, cuda=cuda)


def test_auto_falls_back_to_torch_with_the_reason(fresh_probe, monkeypatch):
    """CuPy imports but NVRTC cannot compile: auto must not pick it, and must say why."""
    backends = fresh_probe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake = _fake_cupy(RuntimeError("nvrtc: error: failed to open libnvrtc-builtins.so.13.0"))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    ok, why = backends.cupy_probe("cuda:0")
    assert not ok and "could not compile and load" in why and "libnvrtc-builtins" in why
    with pytest.warns(RuntimeWarning, match="backend 'auto' uses torch: .*libnvrtc-builtins"):
        assert backends.get_backend("auto", torch.device("cuda")).name == "torch"
    with pytest.raises(RuntimeError, match="backend 'cupy' is unusable: .*libnvrtc-builtins"):
        backends.get_backend("cupy", torch.device("cuda"))


def test_auto_picks_cupy_once_a_kernel_compiles(fresh_probe, monkeypatch):
    backends = fresh_probe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(None))
    assert backends.cupy_probe() == (True, "CuPy 14.2.0 compiled and loaded the kernels on cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.get_backend("auto", torch.device("cuda")).name == "cupy-factored"
        assert backends.get_backend("cupy", torch.device("cuda")).name == "cupy"
        assert backends.get_backend("auto", torch.device("cpu")).name in ("cpu", "torch")  # CPU: no CuPy probe


def test_probe_without_cuda_says_why():
    from bppsa.backends import cupy_probe

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    ok, why = cupy_probe()
    assert not ok and "torch sees no CUDA GPU" in why


def test_launches_go_to_torchs_current_stream(monkeypatch):
    """The handle CuPy's launch reads (``ptr``) is torch's current stream's, the default stream's 0 included."""
    for handle in (0x7F00, 0):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None, h=handle: SimpleNamespace(cuda_stream=h))
        s = runtime.stream(torch.device("cuda", 0))
        assert isinstance(s, runtime.TorchStream) and s.ptr == handle


# ---------------------------------------------------------------------------------------------
# 5. on a GPU: the real CuPy backend
# ---------------------------------------------------------------------------------------------
SCAN_SHAPES = [(n, B, H) for n in (1, 2, 3, 5, 17, 64, 100, 1000) for B in (1, 5, 16) for H in (1, 7, 20, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n,B,H", SCAN_SHAPES)
def test_cupy_scan_matches_torch(n, B, H, dtype):
    be = backend_or_skip("CupyBackend")
    gen = torch.Generator(device="cuda").manual_seed(n * 1000 + B * 100 + H)
    g = torch.randn(B, H, device="cuda", dtype=dtype, generator=gen)
    # Scaled to spectral radius about 1, so products neither vanish nor overflow at n = 1000.
    J = torch.randn(n, B, H, H, device="cuda", dtype=dtype, generator=gen) / H**0.5
    ref = blelloch_scan(g.double(), J.double())
    out = be.scan(g, J.clone())
    assert out.shape == (n, B, H) and out.dtype == dtype
    err = (out.double() - ref).abs().amax() / ref.abs().amax().clamp_min(1e-300)
    assert err <= (1e-10 if dtype == torch.float64 else 1e-4), float(err)


@pytest.mark.gpu
@pytest.mark.parametrize("L_m", [0, 1, 2, 3, "top-1", 20])
@pytest.mark.parametrize("n", [1, 7, 33, 1000])
def test_cupy_heterogeneous_scan_matches_torch(n, L_m):
    be = backend_or_skip("CupyBackend")
    if L_m == "top-1":  # the middle's first block end clipped at N - 1 (N not a power of two)
        L_m = max(0, len(levels(n + 1)) - 1)
    g = torch.randn(5, 20, device="cuda", dtype=torch.float64)
    J = torch.randn(n, 5, 20, 20, device="cuda", dtype=torch.float64) / 20**0.5
    ref = blelloch_scan(g, J, L_m)
    out = be.scan(g, J.clone(), L_m)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10 * float(ref.abs().max()))


@pytest.mark.gpu
def test_cupy_scan_runs_on_torch_current_stream():
    be = backend_or_skip("CupyBackend")
    g = torch.randn(16, 20, device="cuda", dtype=torch.float64)
    J = torch.randn(999, 16, 20, 20, device="cuda", dtype=torch.float64) / 20**0.5
    ref = blelloch_scan(g, J)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        J2 = J.clone()  # produced on s; the kernels must be ordered after it on s
        out = be.scan(g, J2)
    s.synchronize()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_cupy_rejects_what_it_cannot_do():
    be = backend_or_skip("CupyBackend")
    with pytest.raises(ValueError, match="hidden sizes up to"):
        f64 = dict(device="cuda", dtype=torch.float64)
        be.scan(torch.zeros(1, 512, **f64), torch.zeros(1, 1, 512, 512, **f64))
    with pytest.raises(ValueError, match="float32 and float64"):
        f16 = dict(device="cuda", dtype=torch.float16)
        be.scan(torch.zeros(1, 4, **f16), torch.zeros(2, 1, 4, 4, **f16))
    with pytest.raises(RuntimeError, match="CUDA"):
        be.scan(torch.zeros(1, 4), torch.zeros(2, 1, 4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["paper", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,B,H", [(1, 1, 1), (3, 5, 7), (1000, 16, 20), (17, 2, 64)])
def test_cupy_rnn_jacobians_match_torch(layout, dtype, T, B, H):
    be = backend_or_skip("CupyBackend")
    h = torch.tanh(torch.randn(T, B, H, device="cuda", dtype=dtype))
    W = torch.randn(H, H, device="cuda", dtype=dtype)
    # Bit-identical: the kernel rounds h*h, 1 - h*h and the product separately, as torch does.
    assert torch.equal(be.rnn_jacobians_t(h, W, layout), rnn_jacobians_t(h, W, layout))


def _rel_err(g, ref):
    scale = ref.abs().max()
    return float((g - ref).abs().max() / (scale if scale > 0 else 1))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["paper", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B", [1, 5, 16])
@pytest.mark.parametrize("T", [1, 2, 3, 17, 1000])
def test_rnn_training_step_cupy_vs_autograd(T, B, dtype, layout):
    from bppsa.models.rnn import RNNClassifier

    be = backend_or_skip("CupyBackend")
    torch.manual_seed(T * 31 + B)
    model = RNNClassifier().to("cuda", dtype)
    x = torch.bernoulli(torch.full((T, B, 1), 0.35, device="cuda", dtype=dtype))
    y = torch.randint(0, 10, (B,), device="cuda")
    ref_model, bp_model = copy.deepcopy(model), copy.deepcopy(model)
    # TF32 off: with it, cuDNN's fp32 RNN on Ampere and later is itself only ~1e-3 accurate.
    with ieee_fp32():
        ref_loss = ref_model.baseline_step(x, y)
        loss = bp_model.bppsa_step(x, y, be, layout)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert abs(float(loss) - float(ref_loss)) <= tol * max(1.0, abs(float(ref_loss)))
    for (name, p_ref), (_, p) in zip(ref_model.named_parameters(), bp_model.named_parameters()):
        assert p.grad is not None, name
        assert _rel_err(p.grad, p_ref.grad) <= tol, (name, _rel_err(p.grad, p_ref.grad))


@pytest.mark.gpu
def test_cupy_fill_keeps_subnormals(keep_denormals):
    be = backend_or_skip("CupyBackend")
    h, W = _subnormal_case(torch.float32)
    h, W = h.cuda(), W.cuda()
    ref = rnn_jacobians_t(h, W, "fused")
    assert (ref != 0).any()  # torch's twin keeps them; CuPy's -ftz=true must not flush ours
    assert torch.equal(be.rnn_jacobians_t(h, W, "fused"), ref)


@pytest.mark.gpu
def test_cupy_rejects_a_tensor_on_another_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    be = backend_or_skip("CupyBackend")
    g = torch.zeros(1, 4, device="cuda:1")
    with torch.cuda.device(0), pytest.raises(ValueError, match="current CUDA device is cuda:0"):
        be.scan(g, torch.zeros(2, 1, 4, 4, device="cuda:1"))
