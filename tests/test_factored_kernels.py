"""The factored GPU backward (``factored_up.cu``, ``factored.cu``, backend ``cupy-factored``), checked without a GPU.

* the kernel sources run by the emulator (``tests/cuda_emulator.py``) through the plan
  (:func:`bppsa.backends.cuda.plan.factored_plan`): the scan's output and the parameter-gradient sums held to
  the reference scan over the chain's dense Jacobians (``chain.dense()``);
* a whole training step of the RNN and the GRU through that emulated path against autograd;
* the plan's launches, their ``moved`` and ``flop`` counted by hand on a tiny shape, the chunk size;
* the shared-memory access patterns of the kernels: bank conflicts (:func:`bppsa.backends.cuda.plan.bank_conflicts`);
* ``@pytest.mark.gpu``: the real backend against the torch twin and autograd.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from cuda_emulator import backend_or_skip, build_emulator, emulated_factored, emulated_launch, library_for

from bppsa.backends.cpu.chain import GruChain, RnnChain
from bppsa.backends.twin import TorchBackend
from bppsa.scan import reference_scan

TOL = {np.float64: 1e-10, np.float32: 1e-4}


@pytest.fixture(scope="module")
def emu():
    return build_emulator()


def _mv(a, v):
    return torch.matmul(a, v.unsqueeze(-1)).squeeze(-1)


def _chain(kind: str, n: int, B: int, H: int, I: int, seed: int, compiled: bool = False):
    """A chain built from a real forward, in fp64: its factors written by torch, as the GPU builds them (or, with
    ``compiled``, as the CPU fast path builds it: for its compiled builders)."""
    from bppsa.backends.cpu import chain as cpu_chain

    torch.manual_seed(seed)
    x = torch.randn(n, B, I, dtype=torch.float64)
    if kind == "rnn":
        cell = torch.nn.RNN(I, H, nonlinearity="tanh").double()
        with torch.no_grad():
            h, _ = cell(x)
        return (functools.partial(cpu_chain.rnn_chain, RnnChain) if compiled else RnnChain.from_states)(
            h, cell.weight_hh_l0, x)
    cell = torch.nn.GRU(I, H).double()
    with torch.no_grad():  # the factors must not track the cell's gradients (the torch path builds them from it)
        h, _ = cell(x)
        return (cpu_chain.gru_chain if compiled else GruChain.from_states)(x, h, cell)


def _reference(chain, g: torch.Tensor):
    """The scan over chain.dense() (Algorithm 1, position by position) and the sums [NA, I + 1 + H] the down
    kernel accumulates, from that scan and the chain's factors, in fp64."""
    P, _ = reference_scan(g, chain.dense(), matmat=torch.matmul, matvec=_mv)
    P = torch.stack(P)  # [n, B, H]
    return P, _sums(chain, P)


def _sums(chain, P: torch.Tensor) -> torch.Tensor:
    """The sums [NA, I + 1 + H] the down kernel accumulates from the scan's output P and the chain's factors."""
    n, B, H, _ = chain.shape
    I = chain.I
    f = chain.f.permute(0, 2, 1)  # [n, B, NR]
    NF = chain.NF
    cols = torch.cat([f[..., NF * H:NF * H + I], torch.ones(n, B, 1, dtype=f.dtype), f[..., NF * H + I:]], -1)
    lane = lambda i: f[..., i * H:(i + 1) * H]  # noqa: E731
    if chain.kind == "rnn":
        rows = P * lane(0)
    else:
        rows = torch.cat([P * lane(0), P * lane(1), P * lane(4), P * lane(2)], -1)
    acc = torch.einsum("kba,kbc->ac", rows, cols)
    if chain.kind == "gru":
        acc[2 * H:3 * H, I + 1:] = 0  # dN: x and 1 only
        acc[3 * H:, :I] = 0           # dM: 1 and h' only
    return acc


def _flat(chain, acc) -> np.ndarray:
    """The flat parameter gradients (what the kernels write: plan.grad_index) from sums [NA, I + 1 + H]."""
    from bppsa.backends.cuda import plan

    index, _ = plan.grad_index(chain.grad_layout(), chain.I + 1 + chain.shape[2])
    return np.asarray(acc, dtype=np.float64).reshape(-1)[index]


def _views(chain, flat):
    from bppsa.backends.cuda import plan

    return plan.grad_views(torch.as_tensor(np.asarray(flat, dtype=np.float64)), chain.grad_layout(),
                           chain.I + 1 + chain.shape[2])


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max()
    return float(np.abs(got - ref).max() / (scale if scale > 0 else 1.0))


# (n, B, H, C): n mod C != 0, n < C (one chunk: no up, no middle), n == C, several whole chunks, B = 64; H = 21 takes
# the register up kernel in fp32 and the shared-memory one in fp64 (plan.up_columns)
SHAPES = [(37, 1, 7, 8), (5, 2, 7, 8), (16, 1, 20, 16), (24, 3, 20, 8), (9, 64, 7, 4), (37, 2, 20, 8), (19, 2, 21, 8)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("n,B,H,C", SHAPES)
def test_emulated_factored_scan_and_sums(emu, kind, n, B, H, C, dtype):
    I = 1 if kind == "rnn" else 5
    chain = _chain(kind, n, B, H, I, seed=n * 100 + B * 10 + H)
    g = torch.randn(B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(n + B))
    P_ref, acc_ref = _reference(chain, g)
    gd = g.numpy().astype(dtype)
    P, used = emulated_factored(emu, chain, gd, C=C)
    assert used == C and P.dtype == dtype and P.shape == (n, B, H)
    assert not np.isnan(P).any(), "a position was never written"
    assert _rel(P, P_ref) <= TOL[dtype]
    acc, _ = emulated_factored(emu, chain, gd, C=C, grads=True)
    assert acc.shape == _flat(chain, acc_ref).shape and not np.isnan(acc).any()
    assert _rel(acc, _flat(chain, acc_ref)) <= TOL[dtype]
    got = _views(chain, acc)
    for name, ref in chain.param_grads(acc_ref).items():  # the views are the parameters' gradients
        assert got[name].shape == ref.shape and _rel(got[name], ref) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("n,B,H,C", SHAPES)
def test_emulated_affine_scan_and_sums(emu, kind, n, B, H, C, dtype):
    """The per-step-gradient scan (out[k+1] = J_k out[k] + c_k): the chunks' offsets from zero, the carry kernel's
    walk over the chunks, the down kernel with c injected; held to the recurrence over the dense Jacobians."""
    I = 1 if kind == "rnn" else 5
    chain = _chain(kind, n, B, H, I, seed=n * 100 + B * 10 + H + 1)
    gen = torch.Generator().manual_seed(n + B + 1)
    g = torch.randn(B, H, dtype=torch.float64, generator=gen)
    c = torch.randn(n, B, H, dtype=torch.float64, generator=gen)
    J, v, out = chain.dense(), g, []
    for k in range(n):
        out.append(v)
        v = _mv(J[k], v) + c[k]
    P_ref = torch.stack(out)
    P, used = emulated_factored(emu, chain, g.numpy().astype(dtype), C=C, c=c.numpy().astype(dtype))
    assert used == C and not np.isnan(P).any() and _rel(P, P_ref) <= TOL[dtype]
    acc, _ = emulated_factored(emu, chain, g.numpy().astype(dtype), C=C, grads=True, c=c.numpy().astype(dtype))
    assert not np.isnan(acc).any() and _rel(acc, _flat(chain, _sums(chain, P_ref))) <= TOL[dtype]


def _affine_reference(chain, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The per-step-gradient scan out[k+1] = J_k out[k] + c_k over the dense Jacobians, in fp64: [n, B, H]."""
    J, v, out = chain.dense(), g, []
    for k in range(chain.shape[0]):
        out.append(v)
        v = _mv(J[k], v) + c[k]
    return torch.stack(out)


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("I", [1, 12])
@pytest.mark.parametrize("B", [1, 3, 16])
@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_T37_matrix_register_up_and_one_launch_middle(emu, kind, B, I, dtype):
    """Issues 32 and 41's matrix: T = 37 in chunks of C = 4 (nine whole chunks and a short one of one step), the
    register up kernel (H = 20) and the one-launch middle phase with three warps (segments of three transitions: warp 1
    composes its segment into a map), in both dtypes, through the whole emulated backward: the gradient sums of a
    single seed and of a loss on every step against the reference (and, at B = 3, the scan's outputs too)."""
    from bppsa.backends.cuda import plan

    n, H, C, W = 37, 20, 4, 3
    itemsize = np.dtype(dtype).itemsize
    launches = plan.factored_plan(kind, n, B, H, I, C, itemsize=itemsize, warps=W)[1]
    up, mid = launches[0], launches[1]
    assert up.kernel == f"bppsa_factored_up_{kind}" and up.consts == plan.up_constants(H)
    assert (mid.kernel, mid.block, mid.grid) == ("bppsa_factored_middle", 32 * W, B)
    assert plan.middle_segments(-(-n // C), W) == (3, 3)
    chain = _chain(kind, n, B, H, I, seed=37 + B + I)
    gen = torch.Generator().manual_seed(B)
    g = torch.randn(B, H, dtype=torch.float64, generator=gen)
    c = torch.randn(n, B, H, dtype=torch.float64, generator=gen)
    P_ref, acc_ref = _reference(chain, g)
    A_ref = _affine_reference(chain, g, c)
    gd, cd = g.numpy().astype(dtype), c.numpy().astype(dtype)
    acc, _ = emulated_factored(emu, chain, gd, C=C, grads=True, warps=W)
    assert not np.isnan(acc).any() and _rel(acc, _flat(chain, acc_ref)) <= TOL[dtype]
    acc, _ = emulated_factored(emu, chain, gd, C=C, grads=True, c=cd, warps=W)
    assert not np.isnan(acc).any() and _rel(acc, _flat(chain, _sums(chain, A_ref))) <= TOL[dtype]
    if B == 3:
        P, _ = emulated_factored(emu, chain, gd, C=C, warps=W)
        assert not np.isnan(P).any() and _rel(P, P_ref) <= TOL[dtype]
        P, _ = emulated_factored(emu, chain, gd, C=C, c=cd, warps=W)
        assert not np.isnan(P).any() and _rel(P, A_ref) <= TOL[dtype]


@pytest.mark.parametrize("H,warps,affine", [(7, 1, True), (7, 2, False), (7, 4, True), (7, 8, False), (31, 8, True),
                                             (32, 8, False), (33, 8, True)])
def test_one_launch_middle_tree_shapes(emu, H, warps, affine):
    """The middle phase's tree over 18 transitions (n = 37, C = 2) with 1, 2, 4 and 8 warps (segments of 18, 9, 5 and 3:
    a last segment shorter, maps of one to three transitions); H = 31, the widest whose map's H + 1 columns fit a warp;
    H = 32 (staged, but one warp: plan.middle_max_warps) and H = 33 (rows from global memory, two a lane); fp64."""
    from bppsa.backends.cuda import plan

    n, B, C = 37, 2, 2
    mid = plan.factored_plan("rnn", n, B, H, 1, C, itemsize=8, warps=warps, affine=affine)[1][1 + affine]
    assert mid.kernel == "bppsa_factored_middle" and mid.block == 32 * min(warps, plan.middle_max_warps(H, 8))
    chain = _chain("rnn", n, B, H, 1, seed=H + warps)
    gen = torch.Generator().manual_seed(H)
    g = torch.randn(B, H, dtype=torch.float64, generator=gen)
    c = torch.randn(n, B, H, dtype=torch.float64, generator=gen) if affine else None
    want = _affine_reference(chain, g, c) if affine else _reference(chain, g)[0]
    P, _ = emulated_factored(emu, chain, g.numpy(), C=C, c=None if c is None else c.numpy(), warps=warps)
    assert not np.isnan(P).any() and _rel(P, want) <= 1e-10


@pytest.mark.parametrize("mutation", [
    ("a[r] = o != nullptr && i < unsigned(H) ? o[i] : T(0);", "a[r] = T(0);"),  # a walk's offset not injected
    ("N[i] = ofs ? off[tb * H + i] : T(0);", "N[i] = T(0);"),                     # a map's later offsets dropped
    ("if (w + 1 < Wn) apply_map(v, maps + w * Lt::MAP, lane);", ""),             # a segment's map not applied
    ("for (int m = 0; m < H; ++m) {  // N += M[:, m] Q[m]", "for (int m = 1; m < H; ++m) {  // N += M[:, m] Q[m]"),
])
def test_a_broken_middle_kernel_fails(emu, mutation):
    """The one-launch middle phase with an injection, a map or a term of a composition dropped: the per-step scan (n =
    37, C = 2, four warps: segments of five transitions) no longer matches."""
    import cuda_emulator
    from cuda_emulator import build_with_constants

    from bppsa.backends.cuda import plan, runtime

    text = (runtime.KERNEL_DIR / "factored_warp.cu").read_text()
    assert mutation[0] in text
    H = 7
    chain = _chain("rnn", 37, 2, H, 1, seed=11)
    gen = torch.Generator().manual_seed(12)
    g, c = torch.randn(2, H, dtype=torch.float64, generator=gen), torch.randn(37, 2, H, dtype=torch.float64,
                                                                              generator=gen)
    want = _affine_reference(chain, g, c)
    broken = build_with_constants("factored_warp.cu", plan.warp_constants(H, 1), text.replace(*mutation))
    orig = cuda_emulator.library_for
    try:
        cuda_emulator.library_for = lambda lib, step: broken if step.kernel == "bppsa_factored_middle" else orig(lib,
                                                                                                               step)
        P, _ = emulated_factored(emu, chain, g.numpy(), C=2, c=c.numpy(), warps=4)
    finally:
        cuda_emulator.library_for = orig
    assert np.isnan(P).any() or _rel(P, want) > 1e-6


@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("mutation", [
    ("fk + (u + 1) * H * B : (k < e ? fk + stride : fk)", "fk + (u + 1) * H * B : fk"),  # the next step not streamed
    ("fac[g] = fs[(g * H + j) * B] * keep", "fac[g] = fs[(g * H + j + 1) * B] * keep"),    # first step: a row off
    ("const unsigned s = c * C, e", "const unsigned s = c * C + (c > 0), e"),              # a chunk's first step lost
])
def test_a_broken_register_up_kernel_fails(emu, kind, mutation):
    from cuda_emulator import build_with_constants

    from bppsa.backends.cuda import plan, runtime

    text = (runtime.KERNEL_DIR / "factored_up.cu").read_text()
    assert mutation[0] in text
    chain = _chain(kind, 37, 3, 20, 1, seed=3)
    g = torch.randn(3, 20, dtype=torch.float64)
    P_ref, _ = _reference(chain, g)
    consts = plan.up_constants(20)
    broken = build_with_constants("factored_up.cu", consts, text.replace(*mutation))
    import cuda_emulator

    orig = cuda_emulator.library_for
    try:
        cuda_emulator.library_for = lambda lib, step: broken if "_up_" in step.kernel and step.consts else orig(lib,
                                                                                                                 step)
        P, _ = emulated_factored(emu, chain, g.numpy(), C=8)
    finally:
        cuda_emulator.library_for = orig
    assert np.isnan(P).any() or _rel(P, P_ref) > 1e-6


@pytest.mark.parametrize("source,mutation", [
    ("factored_warp.cu", ("nv = (nv + ck) * one;", "nv = nv * one;")),                   # c_k not injected
    ("factored_warp.cu", ("bsum[i * NBV + q] += acc[q];", "bsum[i * NBV + q] = acc[q];")),  # a warp's sums lost
    ("factored_warp.cu", ("if (q <= I) acc[2 * NBV + q] += dn * cq;", "")),               # the GRU's dN dropped
    ("factored_warp.cu", ("if (!sums && !offset && row) P[", "if (!sums && !offset && row && b > 0) P[")),  # P lost
    ("factored.cu", ("for (unsigned w = 0; w < W; ++w) s += part[w * 32 + lane];", "s = part[lane];")),  # warps' parts
    ("factored.cu", ("      s1 += a[(p + W) * entries];", "")),                          # every other part dropped
])
def test_a_broken_warp_down_kernel_or_reduction_fails(emu, source, mutation):
    """The warp down kernel and the gradients' reduction with an injection, a reduction or a gradient row dropped: the
    per-step scan's flat gradients of the GRU (T = 37, C = 1: 111 pairs in 14 blocks of the down kernel, so the
    reduction's eight warps add one or two parts each) or, for P, the scan's output, no longer match."""
    import cuda_emulator
    from cuda_emulator import KERNEL_NAMES, build_source, build_with_constants

    from bppsa.backends.cuda import plan, runtime

    text = (runtime.KERNEL_DIR / source).read_text()
    assert mutation[0] in text
    H, I, B = 7, 2, 3
    chain = _chain("gru", 37, B, H, I, seed=21)
    gen = torch.Generator().manual_seed(22)
    g, c = torch.randn(B, H, dtype=torch.float64, generator=gen), torch.randn(37, B, H, dtype=torch.float64,
                                                                              generator=gen)
    A_ref = _affine_reference(chain, g, c)
    if source == "factored_warp.cu":
        broken = build_with_constants(source, plan.warp_constants(H, I), text.replace(*mutation))
        pick = lambda lib, step: broken if plan.factored_source(step) == source else orig(lib, step)  # noqa: E731
    else:
        body = (runtime.KERNEL_DIR / "blelloch.cu").read_text() + "\n" + text.replace(*mutation)
        broken = build_source(body, tuple(KERNEL_NAMES["blelloch.cu"] + KERNEL_NAMES["factored.cu"]))
        pick = lambda lib, step: orig(lib, step) if step.consts else broken  # noqa: E731
    orig = cuda_emulator.library_for
    try:
        cuda_emulator.library_for = pick
        if "P[" in mutation[0]:
            got, want = emulated_factored(emu, chain, g.numpy(), C=1, c=c.numpy(), warps=3)[0], A_ref
        else:
            got = emulated_factored(emu, chain, g.numpy(), C=1, grads=True, c=c.numpy(), warps=3)[0]
            want = _flat(chain, _sums(chain, A_ref))
    finally:
        cuda_emulator.library_for = orig
    assert np.isnan(got).any() or _rel(got, want) > 1e-6


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("mutation", [None, ("fk[(2 * H + i) * B] = e * r;", "fk[(2 * H + i) * B] = r;"),
                                      ("M += wh[(2 * H + i) * H + m] * hm;", "M += wh[(2 * H + i) * H + m];")])
def test_gru_factor_kernel_is_the_torch_twin(emu, dtype, mutation):
    """bppsa_gru_factors (factored.cu): the GRU's factors from the forward's states in one kernel, T = 37, B = 3,
    H = 20, I = 12, with biases, as GruChain.from_states writes them (fp64 1e-12, fp32 1e-5 of each row's scale); the
    chain's c_n without e, or h_{t-1} left out of M, does not match."""
    from cuda_emulator import KERNEL_NAMES, Buf, build_source

    from bppsa.backends.cuda import plan, runtime

    T, B, H, I = 37, 3, 20, 12
    torch.manual_seed(7)
    cell = torch.nn.GRU(I, H).double()
    x = torch.randn(T, B, I, dtype=torch.float64)
    with torch.no_grad():
        h, _ = cell(x)
        want = GruChain.from_states(x, h, cell).f.numpy()
    lib = emu
    if mutation is not None:
        text = (runtime.KERNEL_DIR / "factored.cu").read_text()
        assert mutation[0] in text
        lib = build_source(text.replace(*mutation), tuple(KERNEL_NAMES["factored.cu"]))
    launch = plan.gru_factors_launch(T, B, H, I)
    ops = [x, h, cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0, cell.bias_hh_l0]
    bufs = [Buf(t.detach().numpy().astype(dtype)) for t in ops] + [Buf(np.full(want.shape, np.nan, dtype=dtype))]
    emulated_launch(lib, launch, dtype, bufs)
    got = bufs[-1].value()
    err = max(_rel(got[:, r], want[:, r]) for r in range(want.shape[1]) if np.abs(want[:, r]).max() > 0)
    if mutation is None:
        assert not np.isnan(got).any() and err <= (1e-12 if dtype == np.float64 else 1e-5), err
        assert np.array_equal(got[:, 5 * H + I:][-1], np.zeros((H, B)))  # h_{-1} = 0 at the last scan step
    else:
        assert err > 1e-6


def test_emulated_factored_middle_with_bounded_tree(emu):
    chain = _chain("rnn", 45, 2, 5, 1, seed=4)
    g = torch.randn(2, 5, dtype=torch.float64)
    P_ref, _ = _reference(chain, g)
    for L_m in (0, 1, None):  # the middle scan over the 12 chunk aggregates, linear, one level, full tree
        P, _ = emulated_factored(emu, chain, g.numpy(), C=4, L_m=L_m)
        assert _rel(P, P_ref) <= 1e-10, L_m


def test_chain_without_x_gives_the_scan(emu):
    torch.manual_seed(0)
    h = torch.tanh(torch.randn(11, 2, 4, dtype=torch.float64))
    chain = RnnChain.from_states(h, torch.randn(4, 4, dtype=torch.float64) / 2)  # I = 0
    g = torch.randn(2, 4, dtype=torch.float64)
    out, _ = emulated_factored(emu, chain, g.numpy(), C=4, grads=True)  # no x: gradients fall back to the scan
    assert out.shape == (11, 2, 4) and _rel(out, _reference(chain, g)[0]) <= 1e-10


# ---------------------------------------------------------------------------------------------
# a whole training step through the emulated path against autograd
# ---------------------------------------------------------------------------------------------
class EmulatedFactored(TorchBackend):
    """CupyFactoredBackend with the kernels run by the emulator: the same chains, plan and reduction."""

    name = "cupy-factored-emulated"

    def __init__(self, lib, C: int):
        super().__init__()
        self.lib, self.C = lib, C

    def rnn_jacobians_t(self, h, W_hh, layout, x=None, act="tanh"):
        assert layout == "fused"
        return RnnChain.from_states(h, W_hh, x, act=act)

    def gru_jacobians_t(self, x, h, cell, gates=None):
        return GruChain.from_states(x, h, cell)

    def cell_grads(self, g, J, L_m, from_scan, c=None):
        acc, _ = emulated_factored(self.lib, J, g.numpy(), C=self.C, grads=True, L_m=L_m,
                                   c=None if c is None else c.numpy())
        return _views(J, acc)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("model", ["rnn", "gru"])
def test_training_step_through_emulated_kernels_matches_autograd(emu, model, dtype):
    from bppsa.models import build

    T, B = 37, 3  # T not a power of two, C = 8: four whole chunks and a short one
    torch.manual_seed(5)
    I = 1 if model == "rnn" else 6
    ref = build(model, I, 20, 10).to(dtype)
    got = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, B, I, generator=gen).to(dtype)
    y = torch.randint(0, 10, (B,), generator=gen)
    loss_ref = ref.baseline_step(x, y)
    loss = got.bppsa_step(x, y, EmulatedFactored(emu, 8), "fused")
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert abs(float(loss) - float(loss_ref)) <= tol
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert q.grad is not None, name
        assert _rel(q.grad, p.grad) <= tol, (name, _rel(q.grad, p.grad))
    assert ref.cell.weight_hh_l0.grad.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# on a GPU: the real backend
# ---------------------------------------------------------------------------------------------
def _gpu_chain(be, kind: str, T: int, B: int, H: int, I: int, dtype, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(T, B, I, device="cuda", dtype=dtype)
    if kind == "rnn":
        cell = torch.nn.RNN(I, H, nonlinearity="tanh").to("cuda", dtype)
        with torch.no_grad():
            h, _ = cell(x)
        return be.rnn_jacobians_t(h, cell.weight_hh_l0, "fused", x)
    cell = torch.nn.GRU(I, H).to("cuda", dtype)
    with torch.no_grad():  # as in the model's step: the factors must not track the cell's gradients
        h, _ = cell(x)
        return be.gru_jacobians_t(x, h, cell)


def _cpu64(chain):
    """The same chain on the CPU in fp64 (the reference's operands)."""
    cls = RnnChain if chain.kind == "rnn" else GruChain
    return cls(chain.W_hh.double().cpu(), chain.f.double().cpu(), chain.I)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("T,B,H,C", [(1, 1, 20, None), (7, 3, 7, None), (37, 5, 20, 8), (1000, 16, 20, None),
                                     (1000, 1, 20, None), (129, 2, 33, 16), (300, 4, 64, 32)])
def test_cupy_factored_matches_the_torch_twin(kind, T, B, H, C, dtype):
    be = backend_or_skip("CupyFactoredBackend")
    chain = _gpu_chain(be, kind, T, B, H, 3, dtype, seed=T + B + H)
    assert isinstance(chain, RnnChain if kind == "rnn" else GruChain) and chain.device.type == "cuda"
    g = torch.randn(B, H, device="cuda", dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    # the torch twin over the dense chain, in fp64
    ref = TorchBackend().scan(g.double(), chain.dense().double())
    out = be._factored(g, chain, None, grads=False, C=C)
    assert out.shape == (T, B, H) and out.dtype == dtype and out.device.type == "cuda"
    assert _rel(out.cpu(), ref.cpu()) <= tol
    torch.testing.assert_close(be.scan(g, chain), ref.to(dtype), rtol=tol, atol=tol * float(ref.abs().max()))
    if not be.sums_fit(chain, dtype, chain.device):  # the GRU at H = 64 in fp64 on an H100/H200 (227 KiB a block)
        with pytest.raises(ValueError, match="shared memory per block"):
            be._factored(g, chain, None, grads=True, C=C)
        return
    acc = be._factored(g, chain, None, grads=True, C=C)
    _, acc_ref = _reference(_cpu64(chain), g.double().cpu())
    want = _flat(_cpu64(chain), acc_ref)
    assert acc.shape == want.shape and _rel(acc.cpu(), want) <= tol


@pytest.mark.gpu
def test_cupy_factored_delegates_dense_chains_and_the_paper_layout():
    be = backend_or_skip("CupyFactoredBackend")
    g = torch.randn(5, 20, device="cuda", dtype=torch.float64)
    J = torch.randn(33, 5, 20, 20, device="cuda", dtype=torch.float64) / 20**0.5
    torch.testing.assert_close(be.scan(g, J.clone()), TorchBackend().scan(g, J.clone()), rtol=1e-10, atol=1e-10)
    h = torch.tanh(torch.randn(4, 5, 20, device="cuda", dtype=torch.float64))
    W = torch.randn(20, 20, device="cuda", dtype=torch.float64)
    assert torch.is_tensor(be.rnn_jacobians_t(h, W, "paper"))  # the faithful dense kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("model", ["rnn", "gru"])
@pytest.mark.parametrize("T,B", [(1, 1), (17, 5), (1000, 16), (1000, 1)])
def test_cupy_factored_training_step_matches_autograd(model, T, B, dtype):
    from bppsa.models import build
    from bppsa.precision import ieee_fp32

    be = backend_or_skip("CupyFactoredBackend")
    assert be.name == "cupy-factored"
    torch.manual_seed(T * 31 + B)
    I = 1 if model == "rnn" else 12
    ref = build(model, I).to("cuda", dtype)
    got = copy.deepcopy(ref)
    x = torch.randn(T, B, I, device="cuda", dtype=dtype)
    if model == "rnn":
        x = torch.bernoulli(torch.full((T, B, I), 0.35, device="cuda", dtype=dtype))
    y = torch.randint(0, 10, (B,), device="cuda")
    with ieee_fp32():  # TF32 off: cuDNN's fp32 RNNs are otherwise only ~1e-3 accurate
        loss_ref = ref.baseline_step(x, y)
        loss = got.bppsa_step(x, y, be, "fused")
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert abs(float(loss) - float(loss_ref)) <= tol * max(1.0, abs(float(loss_ref)))
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert q.grad is not None, name
        assert _rel(q.grad.cpu(), p.grad.cpu()) <= tol, (name, _rel(q.grad.cpu(), p.grad.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["rnn", "gru"])
def test_cupy_factored_training_step_at_H64_fp64_matches_autograd(model):
    """The largest blocks: where the gradient sums' block does not fit (the GRU in fp64 on an H100/H200), the scan's
    output and GEMMs give the gradients; either way they equal autograd's."""
    from bppsa.models import build

    be = backend_or_skip("CupyFactoredBackend")
    torch.manual_seed(64)
    I = 1 if model == "rnn" else 12
    ref = build(model, I, hidden=64).to("cuda", torch.float64)
    got = copy.deepcopy(ref)
    got.cell.flatten_parameters()
    x, y = torch.randn(301, 4, I, device="cuda", dtype=torch.float64), torch.randint(0, 10, (4,), device="cuda")
    loss_ref = ref.baseline_step(x, y)
    loss = got.bppsa_step(x, y, be, "fused")
    assert abs(float(loss) - float(loss_ref)) <= 1e-10 * max(1.0, abs(float(loss_ref)))
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert _rel(q.grad.cpu(), p.grad.cpu()) <= 1e-10, (name, _rel(q.grad.cpu(), p.grad.cpu()))


@pytest.mark.gpu
def test_cupy_factored_is_what_auto_picks_on_a_gpu():
    backend_or_skip("CupyFactoredBackend")
    from bppsa.backends import get_backend

    assert get_backend("auto", torch.device("cuda")).name == "cupy-factored"


@pytest.mark.parametrize("affine", [False, True], ids=["scan", "affine"])
@pytest.mark.parametrize("grads", [False, True], ids=["P", "sums"])
@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("n,B,H,C", [(37, 2, 7, 8), (5, 2, 7, 8), (19, 2, 21, 8)])
def test_the_backends_own_driver_on_emulated_kernels(emu, monkeypatch, kind, n, B, H, C, grads, affine):
    """Without a GPU: ``CupyFactoredBackend._factored`` itself (its buffers, their seeding with g, each launch's
    operands, the final reduction), its CUDA calls replaced by the emulator running each launch on the CPU tensors'
    memory, gives the emulated path's result bit for bit (one chunk, a short last chunk, the register up kernel)."""
    from bppsa.backends import cuda
    from bppsa.backends.cuda import runtime

    class Pointer:  # what emulated_launch reads of a buffer
        def __init__(self, t):
            self.ptr = t.data_ptr()

    def launch(src, step, dtype, dev, args, stream):
        emulated_launch(library_for(emu, step), step, np.float64 if dtype == torch.float64 else np.float32, list(args))

    monkeypatch.setattr(runtime, "import_cupy", lambda: None)
    monkeypatch.setattr(runtime, "check_cuda", lambda dtype, *ts: torch.device("cpu"))
    monkeypatch.setattr(runtime, "smem_optin", lambda dev: 227 * 1024)
    monkeypatch.setattr(runtime, "stream", lambda dev: None)
    monkeypatch.setattr(runtime, "pointer", Pointer)
    monkeypatch.setattr(runtime, "launch", launch)
    I = 1 if kind == "rnn" else 5
    chain = _chain(kind, n, B, H, I, seed=n + H)
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(B, H, dtype=torch.float64, generator=gen)
    c = torch.randn(n, B, H, dtype=torch.float64, generator=gen) if affine else None
    got = cuda.CupyFactoredBackend()._factored(g, chain, None, grads, C=C, c=c)
    want, _ = emulated_factored(emu, chain, g.numpy(), C=C, grads=grads, c=None if c is None else c.numpy())
    assert not torch.isnan(got).any() and np.array_equal(got.numpy(), want)


def test_backend_refuses_what_does_not_fit_in_shared_memory(monkeypatch):
    """Without a GPU: the launcher's CUDA calls replaced, a GPU allowing 48 KiB per block, the GRU at H = 64 in fp64
    (its up block needs 6 pitched 64 x 65 matrices, ~195 KiB) is refused with the numbers, before any launch."""

    from bppsa.backends import cuda
    from bppsa.backends.cuda import runtime

    launched = []
    monkeypatch.setattr(runtime, "import_cupy", lambda: None)
    monkeypatch.setattr(runtime, "check_cuda", lambda dtype, *ts: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "smem_optin", lambda dev: 48 * 1024)
    monkeypatch.setattr(runtime, "stream", lambda dev: None)
    monkeypatch.setattr(runtime, "launch", lambda *a: launched.append(a))
    be = cuda.CupyFactoredBackend()
    x, h = torch.zeros(40, 2, 3, dtype=torch.float64), torch.zeros(40, 2, 64, dtype=torch.float64)
    chain = be.gru_jacobians_t(x, h, torch.nn.GRU(3, 64).double())
    assert not launched  # the factors by torch: their kernel's weights (104 KiB at H = 64) do not fit 48 KiB
    with pytest.raises(ValueError, match=r"'cupy-factored' needs \d+ bytes of shared memory .* allows 49152"):
        be.scan(torch.zeros(2, 64, dtype=torch.float64), chain)
    assert not launched
    small = be.gru_jacobians_t(x[:, :, :3], torch.zeros(40, 2, 5, dtype=torch.float64), torch.nn.GRU(3, 5).double())
    assert [a[1].kernel for a in launched] == ["bppsa_gru_factors"]  # at H = 5 the factors' kernel
    launched.clear()
    monkeypatch.setattr(runtime, "pointer", lambda t: t)
    be.scan(torch.zeros(2, 5, dtype=torch.float64), small)  # fits: up, the middle scan, down
    assert [a[1].kernel for a in launched][0] == "bppsa_factored_up_gru" and launched[-1][0] == "factored_warp.cu"


def test_gradient_sums_that_do_not_fit_fall_back_to_the_scan(monkeypatch):
    """Without a GPU: where the down kernel with the gradient sums would exceed the block's shared memory but the scan's
    kernels fit, ``cell_grads`` scans (mode 0, the output P) and hands P to the GEMMs instead of failing."""

    from bppsa.backends import cuda
    from bppsa.backends.cuda import plan, runtime

    H, I = 64, 3
    up, down = plan.factored_smem("gru", H, I, grads=False)
    limit = max(up, down) * 8  # fp64: the scan fits, the sums' block (down with grads) does not
    assert max(plan.factored_smem("gru", H, I, grads=True)) * 8 > limit
    launched = []
    monkeypatch.setattr(runtime, "import_cupy", lambda: None)
    monkeypatch.setattr(runtime, "check_cuda", lambda dtype, *ts: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "smem_optin", lambda dev: limit)
    monkeypatch.setattr(runtime, "stream", lambda dev: None)
    monkeypatch.setattr(runtime, "launch", lambda *a: launched.append(a))
    monkeypatch.setattr(runtime, "pointer", lambda t: t)
    be = cuda.CupyFactoredBackend()
    x, h = torch.zeros(40, 2, I, dtype=torch.float64), torch.zeros(40, 2, H, dtype=torch.float64)
    chain = be.gru_jacobians_t(x, h, torch.nn.GRU(I, H).double())
    assert not be.sums_fit(chain, torch.float64, torch.device("cuda", 0))
    got = be.cell_grads(torch.zeros(2, H, dtype=torch.float64), chain, None, lambda P: {"from_scan": P.shape})
    assert got == {"from_scan": (40, 2, H)}
    down = [a[1] for a in launched if a[1].kernel.startswith("bppsa_factored_down")]
    assert down and all(step.ints[-1] == 0 for step in down)  # mode 0: the scan's output, no sums


def test_without_cuda_the_backend_says_why():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the backend may be usable")
    from bppsa.backends import BACKENDS, get_backend

    assert "cupy-factored" in BACKENDS
    with pytest.raises(RuntimeError, match="backend 'cupy-factored' is unusable: torch sees no CUDA GPU"):
        get_backend("cupy-factored")
    from bppsa.backends.cuda import CupyFactoredBackend

    assert CupyFactoredBackend.name == "cupy-factored"


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_torch_built_factors_as_the_gpu_builds_them(emu, kind):
    """On a GPU the chains' factors are built by torch (the compiled builder reads host memory only): the same
    factors as the compiled builder's, and the emulated kernels on them hold to the reference."""
    from bppsa.backends.cpu import native

    if not native.available():
        pytest.skip(f"no compiled kernel: {native.unavailable_reason()}")
    native_built = _chain(kind, 19, 3, 6, 2, seed=9, compiled=True)
    torch_built = _chain(kind, 19, 3, 6, 2, seed=9)
    # the compiled path really is another writer: the RNN's chain holds the states, the GRU's a compiled gate pass
    assert native_built.states is not None if kind == "rnn" else isinstance(native_built._fill, native.GruFill)
    assert torch_built.states is None and torch_built._f is not None
    torch.testing.assert_close(torch_built.f, native_built.f, rtol=1e-13, atol=1e-13)
    g = torch.randn(3, 6, dtype=torch.float64)
    P_ref, acc_ref = _reference(torch_built, g)
    P, _ = emulated_factored(emu, torch_built, g.numpy(), C=4)
    acc, _ = emulated_factored(emu, torch_built, g.numpy(), C=4, grads=True)
    assert _rel(P, P_ref) <= 1e-10 and _rel(acc, _flat(torch_built, acc_ref)) <= 1e-10
