"""The CPU kernels on every build target: each variant of the scan (chain_scan.c) and of the forward (forward.c)
compiles for x86-64-v3 (AVX2) and x86-64-v4 (AVX-512), and for aarch64 where a cross compiler is installed, with no
vector built piecewise; gradients equal autograd's and the forward torch's under both x86 builds (each on a CPU that
runs it); a kernel damaged in the cache is rebuilt, never loaded."""
import os
import shutil
import subprocess
import sys
from importlib import resources

import pytest
import torch

from bppsa.backends.cpu import native
from bppsa.verify import verify

SRC = resources.files("bppsa.backends.cpu").joinpath("chain_scan.c")
FORWARD = resources.files("bppsa.backends.cpu").joinpath("forward.c")
TARGETS = {"x86-64-v3": ("cc", ["-march=x86-64-v3"], 32), "x86-64-v4": ("cc", ["-march=x86-64-v4"], 64),
           "aarch64": ("aarch64-linux-gnu-gcc", ["-march=armv8-a"], 16)}
CHECKS = ["-Wall", "-Werror", "-Werror=vector-operation-performance"]


@pytest.mark.matrix
@pytest.mark.parametrize("kind,act", [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0)],
                         ids=["rnn", "rnn-relu", "paper", "gru", "lstm"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_kernel_variant_compiles_without_a_piecewise_vector(target, kind, act, tmp_path):
    """The lane widths whose code differs (one lane: the rows as the vector; a whole register) in both dtypes, at
    the benchmarks' hidden size 20, and a whole register at an odd hidden size 33 (several column tiles on every
    target; the LSTM's state is twice it): no vector operation expanded piecewise (a vector wider than the target's
    register, or an operation it lacks) and no warning at all.  (A narrower slice's vectors are strictly smaller
    than a register's.)"""
    cc, march, vbytes = TARGETS[target]
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} (Debian: apt-get install gcc-aarch64-linux-gnu)")
    state = 2 if kind == 3 else 1
    base = [*march, "-O3", "-fPIC", "-std=gnu11", "-pthread"]
    pch = native._precompiled(cc, base, target)  # the system headers precompiled, as native.build compiles
    for real, bits in (("float", 32), ("double", 64)):
        full = vbytes * 8 // bits
        for lanes, H in ((1, 20), (full, 20), (full, 33)):
                defs = [f"-DKIND={kind}", f"-DHID={state * H}", f"-DLANES={lanes}", f"-DREAL={real}",
                        f"-DREALBITS={bits}", f"-DACT={act}"]
                r = subprocess.run([cc, *base, *pch, *CHECKS, *defs, "-c", "-o", str(tmp_path / "k.o"), str(SRC)],
                                   capture_output=True, text=True, timeout=300)
                assert r.returncode == 0 and not r.stderr.strip(), (target, defs, r.stderr[-2000:])


@pytest.mark.matrix
@pytest.mark.parametrize("cell", [0, 1, 2, 3])
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_forward_variant_compiles_without_a_piecewise_vector(target, cell, tmp_path):
    """The forward of every cell in both dtypes, at the benchmarks' H = 20 and at H = 33 (several row tiles with a
    rest, a rest of the activations' groups; the input size is the call's, not the build's): no vector expanded
    piecewise and no warning at all."""
    cc, march, vbytes = TARGETS[target]
    if shutil.which(cc) is None:
        pytest.skip(f"no {cc} (Debian: apt-get install gcc-aarch64-linux-gnu)")
    base = [*march, "-O3", "-fPIC", "-std=gnu11", "-pthread"]
    pch = native._precompiled(cc, base, target)
    for (real, bits), H in ((("float", 32), 20), (("double", 64), 33)):
        # a register's lanes, and the half of one that forward.plan_lanes may take (not below 32 bytes)
        for nbytes in [vbytes] + ([vbytes // 2] if vbytes // 2 >= 32 else []):
            lanes = nbytes * 8 // bits
            defs = [f"-DCELL={cell}", f"-DHID={H}", f"-DLANES={lanes}", f"-DREAL={real}",
                    f"-DREALBITS={bits}"]
            r = subprocess.run([cc, *base, *pch, *CHECKS, *defs, "-c", "-o", str(tmp_path / "f.o"), str(FORWARD)],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and not r.stderr.strip(), (target, defs, r.stderr[-2000:])


def test_a_vector_wider_than_the_register_is_refused_at_compile_time(tmp_path):
    """The kernel's static assert: 16 fp32 lanes (64 bytes) for an AVX2 target do not build."""
    r = subprocess.run(["cc", "-march=x86-64-v3", "-O1", "-fPIC", "-std=gnu11", "-c", "-DKIND=0", "-DHID=4",
                        "-DLANES=16", "-DREAL=float", "-DREALBITS=32", "-o", str(tmp_path / "k.o"),
                        str(SRC)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "fits one register" in r.stderr


def _cpu_has(flags) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            have = set(" ".join(ln.split(":", 1)[1] for ln in f if ln.startswith("flags")).split())
    except OSError:
        return False
    return all(f in have for f in flags)


@pytest.fixture(params=["x86-64-v3", "x86-64-v4"])
def isa(request, monkeypatch):
    """The kernel built for an x86 level (skipped where this CPU cannot run it), and the default build after."""
    if os.uname().machine != "x86_64":
        pytest.skip("an x86-64 build target")
    if not _cpu_has(native.ISAS[request.param]):
        pytest.skip(f"this CPU cannot run {request.param} ({', '.join(native.ISAS[request.param])})")
    monkeypatch.setenv("BPPSA_CPU_ISA", request.param)
    native.reset()
    yield request.param
    monkeypatch.undo()
    native.reset()


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_equal_autograd_under_each_x86_build(isa, dtype):
    """The RNN (both layouts) and the GRU through the CPU fast path, lengths whose N = T + 1 is no power of two,
    batches of one lane slice, one more than a slice, and several slices with a rest (16, 17, 33)."""
    tg = native.target()
    assert tg["isa"] == isa and tg["vector_bytes"] == {"x86-64-v3": 32, "x86-64-v4": 64}[isa], tg
    assert native.unavailable_reason() is None, native.unavailable_reason()
    for B in (16, 17, 33):
        for model, layout, T in (("rnn", "fused", 100), ("rnn", "paper", 37), ("gru", "fused", 37)):
            r = verify(model, seq_len=T, batch=B, dtype=dtype, backend="cpu", layout=layout, seed=B)
            assert r["backend"] == "cpu" and r["ok"], (isa, model, layout, B, r["max_rel_err"])
    _lstm_equals_autograd(torch.float64 if dtype == "float64" else torch.float32)


def _lstm_equals_autograd(dtype):
    """The LSTM's kernel kind under this build (bppsa.verify has no LSTM model yet): torch.nn.LSTM's parameter
    gradients of a loss on h_T, from the kernel's sums (mode 1, full tree and linear), against autograd's."""
    from bppsa.backends.chain import LstmChain
    from bppsa.backends.cpu import CpuBackend
    from bppsa.jacobians.lstm import lstm_gates

    T, B, I, H = 37, 17, 3, 20
    gen = torch.Generator().manual_seed(0)
    lstm = torch.nn.LSTM(I, H).to(dtype)
    x = torch.randn(T, B, I, generator=gen, dtype=dtype)
    out, _ = lstm(x)
    w = torch.randn(B, H, generator=gen, dtype=dtype)
    (out[-1] * w).sum().backward()
    with torch.no_grad():  # every c_t, which torch.nn.LSTM does not return: the states step by step
        cs, c, h = [], torch.zeros(B, H, dtype=dtype), torch.zeros(B, H, dtype=dtype)
        for t in range(T):
            _, (h1, c1) = lstm(x[t:t + 1], (h[None], c[None]))
            h, c = h1[0], c1[0]
            cs.append(c)
        hs = out.detach()
    p = [t.detach() for t in (lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0)]
    be = CpuBackend()
    chain = be.lstm_jacobians_t(x, hs, lambda: lstm_gates(x, hs, torch.stack(cs), *p), p[1])
    assert isinstance(chain, LstmChain)
    g = torch.cat([w, torch.zeros(B, H, dtype=dtype)], -1)
    for L_m in (None, 0):
        got = be.cell_grads(g, chain, L_m, None)
        for k, v in lstm.named_parameters():
            err = ((got[k] - v.grad).abs().max() / v.grad.abs().max()).item()
            assert err <= (1e-10 if dtype == torch.float64 else 1e-4), (k, L_m, err)


@pytest.mark.matrix
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_forward_equals_torch_under_each_x86_build(isa, dtype):
    """Every cell at a batch of one register and a rest (17), lengths ending inside the sequence."""
    import torch
    from test_cpu_forward import CELLS, check

    for cell in CELLS:
        check(cell, 37, 17, 1, 20, getattr(torch, dtype), lengths=True)


def test_an_unknown_build_target_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("BPPSA_CPU_ISA", "pentium4")
    native.reset()
    try:
        with pytest.raises(ValueError, match="BPPSA_CPU_ISA='pentium4'.*x86-64-v3"):
            native.target()
    finally:
        monkeypatch.undo()
        native.reset()


@pytest.mark.skipif(os.uname().machine != "x86_64" or _cpu_has(native.ISAS["x86-64-v4"]),
                    reason="a CPU without AVX-512")
def test_a_target_this_cpu_cannot_run_falls_back_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("BPPSA_CPU_ISA", "x86-64-v4")
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        assert "x86-64-v4 needs CPU features this CPU lacks (avx512f" in native.unavailable_reason()
        assert not list(tmp_path.rglob("*.so"))  # nothing built that could not run
    finally:
        monkeypatch.undo()
        native.reset()


# -- a damaged cache --------------------------------------------------------------------------------------

_VERIFY = [sys.executable, "-m", "bppsa", "verify", "--model", "rnn", "--seq-len", "37", "--batch", "3",
           "--backend", "cpu", "--dtype", "float64"]


def _damage(so, how: str) -> None:
    data = bytearray(so.read_bytes())
    if how == "truncated":  # a copy or a write cut short
        so.write_bytes(data[: len(data) // 3])
    else:  # 64 bytes zeroed in the middle (a torn page)
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(64)
        so.write_bytes(data)


# the tests of a damaged cache go to one worker together (--dist loadgroup), which builds their cache once
built_once = pytest.mark.xdist_group("built_cache")


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A kernel cache that `bppsa verify` built (each test damages a copy of it)."""
    path = tmp_path_factory.mktemp("built")
    r = subprocess.run(_VERIFY, env={**os.environ, "BPPSA_CACHE_DIR": str(path)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return path


@built_once
@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "garbled"])
def test_a_damaged_kernel_in_the_cache_is_rebuilt_and_the_run_finishes(how, built_cache, tmp_path):
    shutil.copytree(built_cache, tmp_path, dirs_exist_ok=True)
    env = {**os.environ, "BPPSA_CACHE_DIR": str(tmp_path)}
    kernels = sorted((tmp_path / "native").glob("chain_scan_*.so"))
    assert kernels and all((so.with_suffix(".sha256")).exists() for so in kernels)
    for so in kernels:
        _damage(so, how)
    r = subprocess.run(_VERIFY, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and '"ok": true' in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert "does not match its checksum (damaged); rebuilding it" in r.stderr
    assert all(native._intact(so) for so in kernels)  # whole again


@built_once
@pytest.mark.slow
def test_a_damaged_kernel_whose_rebuild_fails_falls_back_with_the_reason(built_cache, tmp_path):
    """The rebuild itself yields no loadable kernel (a compiler that writes garbage): the run finishes on the
    fallback, and the reason names the kernel."""
    shutil.copytree(built_cache, tmp_path / "cache")
    env = {**os.environ, "BPPSA_CACHE_DIR": str(tmp_path / "cache")}
    for so in (tmp_path / "cache" / "native").glob("chain_scan_*.so"):
        _damage(so, "truncated")
    bad = tmp_path / "badcc"  # answers the target query as cc does, "builds" garbage
    bad.write_text("#!/bin/sh\ncase \"$*\" in *-dM*) exec cc \"$@\";; *--version*) exec cc \"$@\";; esac\n"
                   "while [ $# -gt 0 ]; do [ \"$1\" = -o ] && { echo garbage > \"$2\"; exit 0; }; shift; done\n")
    bad.chmod(0o755)
    auto = [a if a != "cpu" else "auto" for a in _VERIFY]
    r = subprocess.run(auto, env={**env, "CC": str(bad)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and '"backend": "torch"' in r.stdout and '"ok": true' in r.stdout, (r.stdout, r.stderr)
    assert "backend 'auto' uses torch: the CPU fast path's compiled kernel is unavailable (OSError:" in r.stderr
