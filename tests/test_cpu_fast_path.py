"""The CPU fast path (backend 'cpu', bppsa.backends.cpu) held to its torch reference twin."""
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bppsa import backends, scan
from bppsa.backends import cpu
from bppsa.backends.chain import FactoredChain, LstmStates
from bppsa.backends.cpu import native, plan, pool
from bppsa.backends.cpu.chain import native_chain_scan
from bppsa.backends.cpu.plan import lane_slices
from bppsa.jacobians.gru import gru_gate_grads, gru_gates, gru_jacobians_t, gru_param_grads
from bppsa.jacobians.recurrent import rnn_grad_preact, rnn_jacobians_t
from bppsa.models import build
from bppsa.verify import verify


def _chain(n, B, H, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    J = torch.randn(n, B, H, H, generator=g, dtype=dtype) / math.sqrt(H)
    return torch.randn(B, H, generator=g, dtype=dtype), J


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.fixture(params=["one chunk", "many chunks"])
def chunking(request, monkeypatch):
    """Run each test single-chunk and with every level split across threads (tiny chunks)."""
    if request.param == "many chunks":
        monkeypatch.setattr(plan, "MIN_CHUNK_FLOP", 1)
        old = torch.get_num_threads()
        torch.set_num_threads(3)  # more chunks than this machine's cores: the split itself is exercised
        yield
        torch.set_num_threads(old)
    else:
        monkeypatch.setattr(plan, "MIN_CHUNK_FLOP", float("inf"))
        yield


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 300), B=st.integers(1, 5), H=st.integers(1, 9),
       L_m=st.one_of(st.none(), st.integers(0, 10)), seed=st.integers(0, 2 ** 16))
def test_scan_equals_torch_twin(chunking, n, B, H, L_m, seed):
    assume(n & (n + 1))  # scan length N = n + 1 not a power of two
    g, J = _chain(n, B, H, seed)
    J0 = J.clone()
    got = cpu.cpu_scan(g, J, L_m)
    assert torch.equal(J, J0)  # the chain is not used as scratch
    ref = scan.blelloch_scan(g, J, L_m)
    assert got.shape == ref.shape == (n, B, H)
    assert _rel(got, ref) <= 1e-12
    assert _rel(got, scan.linear_scan(g, J)) <= 1e-10


@pytest.fixture(params=["compiled kernel", "numpy"])
def chain_path(request, monkeypatch):
    """Run the factored chain's scan through the compiled kernel and through its numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(native, "available", lambda: False)
    elif not native.available():
        pytest.skip(f"the compiled kernel is unavailable here: {native.unavailable_reason()}")


def _factored(kind, T, B, H, seed, dtype, scale=1.0, I=2):
    """A chain of ``kind`` built by the cpu backend (with inputs of size I), the torch twin's dense chain,
    the reference parameter gradients from a scan's output (what the kernel accumulates in mode 1), and
    the same gradients computed in float64 from the same inputs (upcast): the exact value that an fp32
    result is held to, free of the fp32 reference's own rounding, with the sums of the same terms' magnitudes
    (what the rounding of a sum over T steps is relative to)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(B, H, generator=gen, dtype=dtype)
    x = torch.randn(T, B, I, generator=gen, dtype=dtype)
    if kind == "gru":
        cell = torch.nn.GRU(I, H).to(dtype)
        with torch.no_grad():
            for p in cell.parameters():
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=dtype) / math.sqrt(H))
            h, _ = cell(x)
            gates = gru_gates(x, h, cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0, cell.bias_hh_l0)
        chain = cpu.CpuBackend().gru_jacobians_t(x, h, cell)
        dense = gru_jacobians_t(gates, cell.weight_hh_l0)

        def exact():
            x64, h64, w = x.double(), h.double(), [p.detach().double() for p in cell.parameters()]
            gates64 = gru_gates(x64, h64, *w)
            out = scan.linear_scan(g.double(), gru_jacobians_t(gates64, w[1]))
            G = gru_gate_grads(gates64, out.flip(0))
            return gru_param_grads(x64, h64, G), gru_param_grads(x64.abs(), h64.abs(), G.abs())

        return g, chain, dense, lambda out: gru_param_grads(x, h, gru_gate_grads(gates, out.flip(0))), exact
    h = torch.tanh(torch.randn(T, B, H, generator=gen, dtype=dtype))
    W = scale * torch.randn(H, H, generator=gen, dtype=dtype) / math.sqrt(H)
    layout = "fused" if kind == "rnn" else "paper"
    chain = cpu.CpuBackend().rnn_jacobians_t(h, W, layout, x)

    def exact():
        out = scan.linear_scan(g.double(), rnn_jacobians_t(h.double(), W.double(), layout))
        ga = rnn_grad_preact(out, h.double(), layout)
        return (_rnn_param_grads(x.double(), h.double(), ga),
                _rnn_param_grads(x.double().abs(), h.double().abs(), ga.abs()))

    return (g, chain, rnn_jacobians_t(h, W, layout),
            lambda out: _rnn_param_grads(x, h, rnn_grad_preact(out, h, layout)), exact)


def _rnn_param_grads(x, h, grad_a):
    """The RNN cell's parameter gradients from ∇a_t: sums over every step and batch element, as single GEMMs over
    the T·B rows (h_0 = 0 adds nothing to W_hh's)."""
    T, B, H = h.shape
    ga = grad_a.reshape(T * B, H)
    gb = ga.sum(0)
    return {"weight_ih_l0": ga.t() @ x.reshape(T * B, -1), "weight_hh_l0": ga[B:].t() @ h[:-1].reshape((T - 1) * B, H),
            "bias_ih_l0": gb, "bias_hh_l0": gb.clone()}


def _assert_identical(got, want) -> None:
    """The same scan (a tensor) or the same parameter gradients (a dict of tensors), bit for bit."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _rel_grads(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].shape == ref[k].shape, k
    return max(_rel(got[k].double(), ref[k].double()) for k in ref)


# (hidden, input) sizes of the compiled-kernel examples: a one-unit edge, odd and even sizes, 1 to 3
# inputs. A few fixed pairs, not every combination: each (kind, H, I, lanes, dtype) is a ~1 s C build,
# and drawing H and I freely built over a hundred kernels per run.
KERNEL_SIZES = [(1, 3), (7, 1), (6, 2)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["rnn", "paper", "gru"]), T=st.integers(1, 300), B=st.integers(1, 5),
       HI=st.sampled_from(KERNEL_SIZES), L_m=st.one_of(st.none(), st.integers(0, 10)),
       dtype=st.sampled_from([torch.float64, torch.float32]), seed=st.integers(0, 2 ** 16))
def test_factored_chain_scan_equals_torch_twin(chunking, chain_path, kind, T, B, HI, L_m, dtype, seed):
    """Each chain kept as its weights and factors (compiled kernel; numpy: the RNN's level 0 as one GEMM,
    the others their dense chain) gives the dense chain's scan, and the parameter gradients the kernel
    accumulates equal those of the model's own reductions over that scan."""
    H, I = HI
    g, chain, dense, ref_grads, exact = _factored(kind, T, B, H, seed, dtype, I=I)
    n = dense.shape[0]
    assume(n & (n + 1))  # scan length N = n + 1 not a power of two
    assert isinstance(chain, FactoredChain) and chain.shape == dense.shape
    if kind == "gru":  # its gates recomputed by the kernel's own vector exp: a few ulp from torch's
        assert _rel(chain.dense(), dense) <= (1e-14 if dtype == torch.float64 else 1e-6)
    else:
        assert torch.equal(chain.dense(), dense)
    ref = scan.blelloch_scan(g, dense.clone(), L_m)
    assume(torch.isfinite(ref).all())  # an fp32 chain that overflows has no relative error to check
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert _rel(cpu.cpu_scan(g, chain, L_m), ref) <= tol
    grads = cpu.param_grads(g, chain, L_m, scan.Workspace(), ref_grads)
    # sums over T steps, added in another order: relative to the terms' magnitudes (terms that cancel leave a sum
    # far smaller than them: W_hh's at H = 1, T = 277 came out -2e-5 from terms of ~1, 1.2e-12 from the reference's)
    exact_grads, mags = exact()
    want = ref_grads(ref) if dtype == torch.float64 else exact_grads  # fp32: the exact value, free of its rounding
    assert grads.keys() == want.keys()
    err = max(((grads[k].double() - want[k].double()).abs().max() / mags[k].max().clamp_min(1e-300)).item()
              for k in want)
    assert err <= (tol if dtype == torch.float64 else 1e-4)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_one_scan_build_serves_every_input_size(kind):
    """The input size is the call's, not the build's: chains of inputs 1, 3 and 12 at one hidden size scan on the
    same builds, each exact (its scan and its parameter gradients, W_ih's among them)."""
    native.library.cache_clear()
    builds = None
    for I in (1, 3, 12):
        g, chain, dense, ref_grads, _ = _factored(kind, 41, 3, 6, I, torch.float64, I=I)
        ref = scan.blelloch_scan(g, dense.clone(), None)
        assert _rel(cpu.cpu_scan(g, chain, None), ref) <= 1e-12
        grads, want = cpu.param_grads(g, chain, None, scan.Workspace(), ref_grads), ref_grads(ref)
        assert grads.keys() == want.keys() and max(_rel(grads[k], want[k]) for k in want) <= 1e-11
        if builds is None:
            builds = native.library.cache_info().currsize
    assert native.library.cache_info().currsize == builds


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("mode", ["slices", "blocks"])
# H = 20 throughout: these cases already need every lane width at H = 20, and each other hidden size would
# be another ~20 C builds (other sizes: the hypothesis tests above)
@pytest.mark.parametrize("n,B,H", [(1000, 16, 20), (999, 40, 20), (257, 7, 20), (2, 3, 20), (333, 1, 20)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["rnn", "paper", "gru"])
def test_compiled_kernel_both_thread_splits(kind, mode, n, B, H, dtype, monkeypatch):
    """Threads taking whole lane slices, or splitting each slice's blocks (B = 1: blocks as the lanes):
    the same scan and parameter gradients, at the sizes the benchmarks run (full vector registers of
    lanes, several slices, hidden size 20)."""
    monkeypatch.setattr(plan, "MIN_CHUNK_FLOP", 1)
    g, chain, dense, ref_grads, _ = _factored(kind, n, B, H, n, dtype, scale=0.3, I=12 if kind == "gru" else 1)
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    # the reference: the full tree in fp64 (every L_m's exact result is the same scan; their fp64 roundings differ by
    # ~1e-16, far inside the tolerances), and its parameter gradients
    ref = scan.blelloch_scan(g.double(), dense.double(), None)
    want = ref_grads(ref.to(dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    try:
        for L_m in (None, 0, 2, plan.fused_levels(dense.shape[0]) + 1):
            L = scan.tree_levels(dense.shape[0] + 1, L_m)
            got = native_chain_scan(g, chain, L, scan.Workspace(), mode)
            assert _rel(got.double(), ref) <= tol, (L_m, mode)
            got = native_chain_scan(g, chain, L, scan.Workspace(), mode, grads=True)
            assert _rel_grads(got, want) <= tol, (L_m, mode)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["rnn", "paper"])
@pytest.mark.parametrize("B", [2, 5, 40])
@pytest.mark.parametrize("split", ["slices", "blocks"])
def test_the_rnn_scanned_from_its_states_equals_the_scan_of_its_written_factors(kind, B, split):
    """The kernel reads the RNN's factors (d = 1 - h², x and h') straight from the forward's states as it
    scans each step, writing none of them: the scan and the parameter gradients are those of the same kernel
    reading the factors the compiled builder writes, bit for bit -- slices of 16, 8, 4 and 1 lanes, the
    wide kernel of one batch element (B = 2), both thread splits -- and the factors it would write equal
    torch's."""
    n = 301
    g, chain, _, _, _ = _factored(kind, n, B, 20, 3, torch.float32)
    assert chain.states is not None
    h, x = chain.states
    L = scan.tree_levels(chain.shape[0] + 1, None)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = [native_chain_scan(g, chain, L, scan.Workspace(), split, grads=grads) for grads in (False, True)]
        assert chain._f is None  # nothing written yet: the next line writes the factors
        written = type(chain)(chain.W_hh, chain.f.clone(), chain.I)
        assert written.states is None
        torch.testing.assert_close(chain.f[:, :20].permute(0, 2, 1), 1 - h.flip(0) * h.flip(0), rtol=0, atol=0)
        for grads, a in zip((False, True), got):
            _assert_identical(a, native_chain_scan(g, written, L, scan.Workspace(), split, grads=grads))
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("B", [2, 16, 40])
def test_the_gru_gate_pass_written_by_the_scans_threads_equals_the_pass_before_it(B):
    """The GRU's gate pass left to the scan's threads (units of steps any thread claims; every up unit waits
    for all of them) writes the factors the pass before the scan writes, and the scan and gradients are the
    same, bit for bit; a writer the kernel cannot run runs first, and its error stops the scan."""
    g, lazy, _, _, _ = _factored("gru", 301, B, 20, 5, torch.float32, I=3)
    _, eager, _, _, _ = _factored("gru", 301, B, 20, 5, torch.float32, I=3)
    whole = eager.f.clone()  # written here, before any scan
    L = scan.tree_levels(lazy.shape[0] + 1, None)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = native_chain_scan(g, lazy, L, scan.Workspace(), "slices", grads=True)
        assert lazy.claim_fill() is None  # the threads wrote it
        torch.testing.assert_close(lazy.f, whole, rtol=0, atol=0)
        _assert_identical(got, native_chain_scan(g, eager, L, scan.Workspace(), "slices", grads=True))
        # a writer the kernel cannot run (not its gate pass) runs before the threads start; its error stops the scan
        _, chain, _, _, _ = _factored("gru", 301, B, 20, 5, torch.float32, I=3)

        def broken(k0, k1):
            raise RuntimeError("the gate pass failed")
        chain._fill = broken
        with pytest.raises(RuntimeError, match="the gate pass failed"):
            native_chain_scan(g, chain, L, scan.Workspace(), "slices", grads=True)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(shutil.which(native.compiler_name()) is None, reason="no C compiler here")
def test_the_kernel_builds_where_a_c_compiler_is():
    """Every kernel test skips where the kernel is unavailable, so a source that stops compiling must fail
    here rather than turn the rest into skips."""
    assert native.unavailable_reason() is None
    for kind in native.KINDS:
        S = 12 if kind == "lstm" else 20  # builds other tests use: hidden size 20; the LSTM's [h; c] at test_nn's 6
        for dtype in (torch.float32, torch.float64):
            for lanes in (1, native.lane_width(kind, dtype)):
                assert native.library(kind, S, lanes, dtype) is not None, (kind, dtype, lanes)


def test_fused_levels_leave_a_tree_of_at_least_eight_blocks():
    assert [plan.fused_levels(n) for n in (1, 2, 127, 128, 255, 256, 511, 512, 1000, 2000, 30000)] == \
        [4, 4, 4, 4, 4, 5, 5, 6, 6, 6, 6]
    for n in range(1, 5000):
        c = plan.fused_levels(n)
        assert 4 <= c <= 6 and (c == 4 or n >> c >= 8), n


def test_lane_slices_are_register_wide_and_balanced():
    assert lane_slices(16, 2, 16) == [[(0, 8)], [(8, 8)]]
    assert lane_slices(1, 2, 16) == [[(0, 1)]]
    for B, p, vl in [(5, 2, 16), (100, 2, 16), (7, 4, 8), (64, 3, 8)]:
        groups = lane_slices(B, p, vl)
        slices = sorted(s for gr in groups for s in gr)
        assert len(groups) <= p and sum(w for _, w in slices) == B
        assert all(w & (w - 1) == 0 and w <= vl for _, w in slices)  # powers of two, one register at most
        assert [b0 for b0, _ in slices] == [0] + [b0 + w for b0, w in slices[:-1]]  # contiguous, disjoint
        loads = [sum(w for _, w in gr) for gr in groups]
        assert max(loads) - min(loads) <= max(w for _, w in slices)


def test_kernel_falls_back_to_numpy_without_a_compiler(tmp_path):
    """No C compiler: the reason is given (doctor prints it) and the cpu backend still gives the scan."""
    code = ("import torch; from bppsa import scan; from bppsa.backends import cpu\n"
            "from bppsa.backends.chain import RnnChain\n"
            "from bppsa.backends.cpu import native\n"
            "print(native.unavailable_reason())\n"
            "h = torch.rand(50, 3, 4, dtype=torch.float64); W = torch.randn(4, 4, dtype=torch.float64)\n"
            "c = RnnChain.from_states(h, W); g = torch.randn(3, 4, dtype=torch.float64)\n"
            "ref = scan.blelloch_scan(g, c.dense())\n"
            "print(((cpu.cpu_scan(g, c) - ref).abs().max() / ref.abs().max()).item())")
    env = {**os.environ, "CC": "no-such-compiler", "BPPSA_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    reason, err = r.stdout.strip().splitlines()
    assert "no C compiler ('no-such-compiler' not on PATH)" in reason and float(err) <= 1e-12
    assert not any(tmp_path.rglob("*.so"))


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
def test_kernel_builds_once_into_the_cache(tmp_path):
    code = "from bppsa.backends.cpu import native; print(native.available())"
    env = {**os.environ, "BPPSA_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.stdout.strip() == "True", r.stderr
        (so,) = (tmp_path / "native").glob("chain_scan_k0_double_H3_L*.so")  # the self-check's one build
        if _ == 0:
            first = so.stat().st_mtime_ns
    assert so.stat().st_mtime_ns == first  # the second process loaded the first one's build
    assert not [p for p in (tmp_path / "native").iterdir() if p.is_dir()]  # no temporary left behind


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
def test_processes_wanting_the_same_kernel_build_it_once(tmp_path):
    """Processes started together on an empty cache (test workers, cluster jobs on a shared cache) compile a
    kernel once: the others wait for that build and load it."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"  # the compiler, logging each kernel build and slow enough for the builds to overlap
    cc.write_text(f"#!/bin/sh\ncase \"$*\" in *-DKIND=*) echo \"$*\" >> {log}; sleep 1;; esac\n"
                  f"exec {shutil.which(native.compiler_name())} \"$@\"\n")
    cc.chmod(0o755)
    code = "from bppsa.backends.cpu import native; print(native.available())"
    env = {**os.environ, "CC": str(cc), "BPPSA_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(out.strip() == "True" for out, _ in outs), [err for _, err in outs]
    builds = log.read_text().splitlines()
    assert len(builds) == 1 and "-DHID=3" in builds[0], builds


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
def test_the_precompiled_system_headers_are_read_and_change_no_byte(tmp_path, monkeypatch):
    """GCC reads the system headers precompiled once (``-H`` lists the .gch it takes, ``-Winvalid-pch`` warns of one
    it cannot), and a kernel built with them is byte for byte the one built without."""
    tg = native.target()
    cc, flags = tg["compiler"], native._FLAGS + tg["flags"]
    if "Free Software Foundation" not in native._compiler_id(cc):
        pytest.skip(f"{cc} is not GCC: its kernels are built without a precompiled header")
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path / "cache"))
    include = native._precompiled(cc, flags, tg["isa"])
    assert include[0] == "-include" and native._intact(Path(include[1] + ".gch"))
    for name, text in native._files("forward.c").items():
        (tmp_path / name).write_bytes(text)
    defs = ["-DCELL=0", "-DHID=6", "-DLANES=1", "-DREAL=float", "-DREALBITS=32"]
    runs = {}
    for how, extra in (("with", [*include, "-H", "-Winvalid-pch"]), ("without", [])):
        so = tmp_path / f"{how}.so"
        runs[how] = subprocess.run([cc, *flags, *extra, *defs, "-o", str(so), str(tmp_path / "forward.c"), "-lm"],
                                   capture_output=True, text=True, timeout=300)
        assert runs[how].returncode == 0, runs[how].stderr
    assert f"! {include[1]}.gch" in runs["with"].stderr and "invalid" not in runs["with"].stderr.lower()
    assert (tmp_path / "with.so").read_bytes() == (tmp_path / "without.so").read_bytes()


def test_importing_bppsa_shortens_the_openmp_spin_unless_set():
    code = ("import os, bppsa, torch; from bppsa import process; torch.ones(4).sum(); r = process.openmp_report(); "
            "print(os.environ['GOMP_SPINCOUNT'], os.environ['KMP_BLOCKTIME'], r['variable'], r['effective'])")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    var = out.split()[2]
    assert out.split()[:2] == ["10000", "0"] and out.split()[3] == "True" and var in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    env["GOMP_SPINCOUNT"] = "77"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "77"
    # torch first: too late, and the report says so
    late = code.replace("import os, bppsa, torch;", "import os, torch, bppsa;")
    env.pop("GOMP_SPINCOUNT")
    assert subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True,
                          check=True).stdout.split()[3] == "False"


def test_this_test_process_runs_with_the_short_openmp_spin():
    from bppsa import process

    assert process.openmp_report()["effective"], process.openmp_report()


@pytest.mark.parametrize("n", [1, 2, 5, 100, 1000])
def test_dense_linear_scan_equals_torch(chunking, n):
    g, J = _chain(n, 4, 20, n)
    assert _rel(cpu.cpu_scan(g, J, 0), scan.linear_scan(g, J)) <= 1e-12


def test_workspace_reuse_gives_the_same_result():
    ws = scan.Workspace()
    for seed in range(3):  # same shapes, new values: stale scratch must never leak into the result
        g, J = _chain(77, 3, 6, seed)
        assert _rel(cpu.cpu_scan(g, J, None, ws), scan.blelloch_scan(g, J)) <= 1e-12


def test_float32_scan_matches(chunking):
    g, J = _chain(999, 16, 20, 1, torch.float32)
    assert _rel(cpu.cpu_scan(g, J), scan.linear_scan(g.double(), J.double()).float()) <= 1e-4


@pytest.mark.parametrize("model", ["rnn", "gru"])
@pytest.mark.parametrize("T,B", [(1, 1), (37, 3), (1000, 16)])
def test_sequential_rival_equals_autograd(chunking, model, T, B):
    """The sequential rival (the linear scan of the same factored chain, batch split over threads) gives
    autograd's gradients."""
    from bppsa.verify import grad_errors

    torch.manual_seed(T)
    net = build(model, input_size=3).double()
    x, y = torch.randn(T, B, 3, dtype=torch.float64), torch.randint(0, 10, (B,))
    ref = copy.deepcopy(net)
    ref.baseline_step(x, y)
    seq = cpu.CpuBackend(sequential=True)
    assert seq.name == "cpu-sequential"
    net.bppsa_step(x, y, seq)
    assert max(grad_errors(ref, net).values()) <= 1e-10


@pytest.mark.parametrize("model,layouts", [("rnn", ["fused", "paper"]), ("gru", ["fused"])])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("L_m", [None, 0, 3])
def test_gradients_equal_autograd_through_the_fast_path(model, layouts, dtype, L_m):
    for layout in layouts:
        for T, B in ((37, 5), (300, 3), (131, 16)):  # B = 16: blocks in fp32, slices in fp64
            r = verify(model=model, seq_len=T, batch=B, dtype=dtype, backend="cpu", layout=layout, L_m=L_m, seed=T)
            assert r["backend"] == "cpu"
            assert r["ok"], (layout, T, B, r["rel_err"])
            assert r["max_rel_err"] <= {"float64": 1e-10, "float32": 1e-4}[dtype]


def test_verify_command_runs_the_cpu_backend(tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, "-m", "bppsa", "verify", "--backend", "cpu", "--seq-len", "101", "--batch", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["backend"] == "cpu" and res["ok"] and res["max_rel_err"] <= 1e-10


def test_cpu_backend_refuses_cuda_and_falls_back_with_a_warning(monkeypatch):
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        backends.get_backend("cpu", torch.device("cuda"))
    assert backends.get_backend("cpu", torch.device("cpu")).name == "cpu"
    monkeypatch.setitem(sys.modules, "bppsa.backends.cpu", None)  # import fails like a broken install
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        be = backends.get_backend("cpu")
    assert be.name == "torch"
    assert any("backend 'cpu' unavailable" in str(x.message) and "bppsa.backends.cpu" in str(x.message) for x in w)


def test_scan_rejects_bad_operands():
    g, J = _chain(5, 2, 3, 0)
    with pytest.raises(ValueError, match="expected g"):
        cpu.cpu_scan(g[:, :2], J)
    with pytest.raises(ValueError, match="one dtype"):
        cpu.cpu_scan(g.float(), J)


def test_worker_threads_follow_the_subnormal_mode():
    """Subnormal products are ~100x slower unless flushed; the workers must flush when the caller does."""
    try:
        for flag in (True, False, True):
            torch.set_flush_denormal(flag)
            assert pool.executor(2).submit(pool.flushing).result() is flag is pool.flushing()
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
def test_the_compiled_scan_flushes_its_subnormal_results_and_gives_the_callers_mode_back():
    """A compiled scan (team_go) and chain product run with subnormal results flushed to zero whatever the caller's
    mode (chain_scan.c's fp_enter: the long products underflow, and x86 takes subnormal results ~100x slower), and
    leave the caller's mode as it was: an fp32 chain whose prefixes fall below the normal range gives 0 where the
    twin, not flushing, keeps subnormals, and the normal prefixes within the fp32 bound."""
    g, chain, dense, _, _ = _factored("rnn", 60, 3, 6, 5, torch.float32, scale=0.05)
    ref = scan.linear_scan(g.double(), dense.double())
    tiny = ref.abs() < 1e-39  # far below fp32's normal range (1.18e-38): fp32 arithmetic gives a subnormal or 0
    normal = ref.abs() > 1e-30
    try:
        torch.set_flush_denormal(False)
        twin = scan.linear_scan(g, dense)
        assert tiny.any() and (twin[tiny] != 0).any()  # the case reaches the subnormal range the twin keeps
        for flag in (False, True, False):
            torch.set_flush_denormal(flag)
            for L_m in (None, 0):
                got = cpu.cpu_scan(g, chain, L_m)
                assert pool.flushing() is flag, L_m  # the caller's mode, given back
                assert torch.equal(got[tiny], torch.zeros_like(got[tiny])), L_m
                assert _rel(got[normal].double(), ref[normal]) <= 1e-4, L_m
            assert cpu.CpuBackend().chain_product(chain) is not None  # the kernel's product, not a fallback
            assert pool.flushing() is flag
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_the_gate_pass_flushes_its_subnormal_results_on_every_path(kind):
    """The compiled gate pass writes the same factors whether a scan's team runs it (in units of steps) or a reader
    of ``chain.f`` calls it directly on the caller's threads: subnormal results flushed to zero either way
    (chain_scan.c's fp_enter), whatever the caller's mode, which it gets back.  fp32 gates whose sigmoid is below
    the normal range (1.2e-38) reach it."""
    T, B, H, I = 40, 3, 6, 2
    gen = torch.Generator().manual_seed(5)
    cell = (torch.nn.GRU if kind == "gru" else torch.nn.LSTM)(I, H)
    with torch.no_grad():
        for p in cell.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for p in (cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0, cell.bias_hh_l0):
            p[: H // 2] = 0  # r's (GRU) or i's (LSTM) first units: pre-activation -88, a sigmoid of 6e-39
        cell.bias_ih_l0[: H // 2] = -88.0
        x = torch.randn(T, B, I, generator=gen)
        h = cell(x)[0]
    be = cpu.CpuBackend()
    try:
        torch.set_flush_denormal(False)
        if kind == "gru":
            make = lambda: be.gru_jacobians_t(x, h, cell)  # noqa: E731
        else:
            c = torch.stack([cell(x[: t + 1])[1][1][0] for t in range(T)]).detach()  # c_1 .. c_T
            states = LstmStates(c, cell.weight_ih_l0.detach(), cell.bias_ih_l0.detach(), cell.bias_hh_l0.detach())
            make = lambda: be.lstm_jacobians_t(x, h, None, cell.weight_hh_l0.detach(), states=states)  # noqa: E731
        gate = torch.sigmoid(torch.tensor(-88.0))
        assert 0 < gate < 1.2e-38  # subnormal in this mode, which keeps them
        direct = make().f.clone()  # read first: the pass runs on the caller's threads
        assert not pool.flushing()
        scanned = make()
        g = torch.randn(B, scanned.shape[-1], generator=gen)
        cpu.cpu_scan(g, scanned, None)  # scanned first: the team runs the pass
        assert not pool.flushing()
        tiny = (direct != 0) & (direct.abs() < 1.2e-38)
        assert not tiny.any()  # no subnormal left by the direct pass
        assert torch.equal(direct, scanned.f)
    finally:
        torch.set_flush_denormal(False)


def test_numpy_blas_is_made_single_threaded():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    cpu.cpu_scan(*_chain(9, 2, 3, 0))
    libs = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]
    assert libs and all(i["num_threads"] == 1 for i in libs)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
def test_more_threads_than_a_team_holds():
    """A machine with more cores than a team's threads (plan.MAX_THREADS): the scan uses that many and is right."""
    g, chain, dense, _, _ = _factored("rnn", 61, 80 * 16, 20, 3, torch.float32)
    L = scan.tree_levels(chain.shape[0] + 1, None)
    old = torch.get_num_threads()
    torch.set_num_threads(plan.MAX_THREADS + 16)
    try:
        got = native_chain_scan(g, chain, L, scan.Workspace(), "slices")
    finally:
        torch.set_num_threads(old)
    assert _rel(got.double(), scan.blelloch_scan(g.double(), dense.double())) <= 1e-5


def _affine_reference(g, J, c):
    """out[k+1] = J_k out[k] + c[k], sequentially (float64)."""
    out = [g.double()]
    for k in range(1, J.shape[0]):
        out.append(scan._mv(J[k - 1].double(), out[-1]) + c[k - 1].double())
    return torch.stack(out)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
# each shape under one thread split (both splits run at B = 17 and B = 33; every other path is split-blind)
@pytest.mark.parametrize("n,B,mode", [(1000, 16, "slices"), (257, 17, "blocks"), (333, 1, "slices"),
                                      (2, 3, "slices"), (37, 33, "blocks"), (99, 17, "slices")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["rnn", "paper", "gru"])
def test_the_kernel_scans_the_affine_recurrence_of_per_step_gradients(kind, dtype, n, B, mode, monkeypatch):
    """A loss on every state: out[k+1] = J_k out[k] + c[k], through every tree depth (L_m), both thread
    splits, one batch element (whose blocks-as-lanes path the affine scan does not take), and the parameter
    gradients accumulated from it -- against the sequential recurrence."""
    monkeypatch.setattr(plan, "MIN_CHUNK_FLOP", 1)
    H = 20
    g, chain, dense, ref_grads, _ = _factored(kind, n, B, H, n + B, dtype, scale=0.3, I=12 if kind == "gru" else 1)
    c = torch.randn(dense.shape[0], B, H, generator=torch.Generator().manual_seed(n), dtype=dtype)
    if kind == "paper":
        c[0::2] = 0  # the loss reads the states (the paper layout's even positions), not the pre-activations
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        ref = _affine_reference(g, dense, c)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for L_m in (None, 0, 2):
            L = scan.tree_levels(dense.shape[0] + 1, L_m)
            got = native_chain_scan(g, chain, L, scan.Workspace(), mode, c=c)
            assert _rel(got.double(), ref) <= tol, (L_m, mode)
            got = native_chain_scan(g, chain, L, scan.Workspace(), mode, grads=True, c=c)
            assert _rel_grads(got, ref_grads(ref.to(dtype))) <= tol, (L_m, mode)
        # no direct gradient at all: the single seed's scan, bit for bit (an odd B has a one-lane slice, whose
        # single seed takes its blocks as lanes: another order of the same sums)
        zero = native_chain_scan(g, chain, L, scan.Workspace(), mode, c=torch.zeros_like(c))
        seed = native_chain_scan(g, chain, L, scan.Workspace(), mode)
        assert torch.equal(zero, seed) if B % 2 == 0 else _rel(zero.double(), seed.double()) <= tol
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("layer", ["RNN", "GRU", "LSTM"])
def test_a_layers_step_builds_only_its_scans_lane_width(layer, monkeypatch):
    """One build per scan: the gate pass (GRU, LSTM) runs on its team's build, no build is made to ask whether the
    kernel is at hand, and a last lane slice narrower than the others runs on their build with spare lanes.  A
    layer's training step at B = 5 builds the one lane width its scan's slices take (each build is ~1 s of
    compiling), no one-lane kernel beside it, and its gradients are autograd's."""
    import bppsa.nn as bnn

    native.reset()
    built, build = [], native._build
    monkeypatch.setattr(native, "_build",
                        lambda kind, H, lanes, *a: built.append((kind, H, lanes)) or build(kind, H, lanes, *a))
    torch.manual_seed(0)
    ref = getattr(torch.nn, layer)(3, 6, dtype=torch.float64)
    ours = getattr(bnn, layer)(3, 6, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(37, 5, 3, dtype=torch.float64)
    for m in (ref, ours):
        out, _ = m(x)
        (out[-1] ** 2).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert _rel(q.grad, p.grad) <= 1e-10, name
    S = 12 if layer == "LSTM" else 6  # the chain's state (the LSTM's [h; c]); H = 3 is the kernel's own self-check
    widths = {lanes for _, H, lanes in built if H == S}
    assert len(widths) == 1 and 1 not in widths, built
