"""The compiled forward of the recurrent layers (bppsa.backends.cpu.forward, forward.c) against torch's own forward:
torch.nn.RNN (tanh, relu), GRU and LSTM on the same weights, oneDNN on and off, with start states, without biases,
with sequence lengths; fp64 within 1e-12 and fp32 within 1e-6 relative (max-abs error over max-abs value of the
whole output).  Few (H, dtype) per kernel build (the input size is the call's): a build is ~1-5 s, and cached."""
import os

import pytest
import torch

from bppsa.backends.cpu import forward, native

pytestmark = pytest.mark.skipif(native.target() is None, reason="no C compiler")

CELLS = ["rnn_tanh", "rnn_relu", "gru", "lstm"]
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def layer(cell, I, H, dtype, seed, bias=True):
    torch.manual_seed(seed)
    kw = dict(input_size=I, hidden_size=H, dtype=dtype, bias=bias)
    if cell.startswith("rnn"):
        return torch.nn.RNN(nonlinearity=cell[4:], **kw)
    return {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[cell](**kw)


def weights(m):
    return (m.weight_ih_l0, m.weight_hh_l0, getattr(m, "bias_ih_l0", None), getattr(m, "bias_hh_l0", None))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The references run torch step by step: on one thread, as a loop of small ops is fastest (and an OpenMP team
    on a busy machine makes each of them wait for its workers)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@torch.no_grad()
def torch_states(cell, m, x, h0, c0, lengths=None):
    """torch.nn's states of every step, (h, c): h by one call of the module where no sequence ends early (torch's
    own forward, oneDNN's where it is on), else -- and c, which torch.nn does not return per step -- by the
    module one step at a time, a sequence past its end keeping its state."""
    T, B, _ = x.shape
    state = (h0[None], c0[None]) if cell == "lstm" else h0[None]
    hs, cs = [], []
    for t in range(T):
        _, new = m(x[t:t + 1], state)
        if lengths is not None:
            on = (t < lengths)[None, :, None]
            new = tuple(torch.where(on, a, b) for a, b in zip(new, state)) if cell == "lstm" else \
                torch.where(on, new, state)
        state = new
        hs.append(state[0][0] if cell == "lstm" else state[0])
        cs.append(state[1][0] if cell == "lstm" else None)
    h = torch.stack(hs)
    if lengths is None:
        whole = m(x, (h0[None], c0[None]) if cell == "lstm" else h0[None])[0]
        assert rel_err(h, whole) < 100 * TOL[x.dtype]  # the stepwise reference is torch's forward
        h = whole
    return h, (torch.stack(cs) if cell == "lstm" else None)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check(cell, T, B, I, H, dtype, *, seed=0, lengths=False, bias=True, zero_start=False, threads=None):
    m = layer(cell, I, H, dtype, seed, bias)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, B, I, generator=gen, dtype=dtype)
    h0, c0 = (torch.randn(B, H, generator=gen, dtype=dtype) for _ in range(2))
    ln = torch.randint(0, T + 2, (B,), generator=gen) if lengths else None
    if zero_start:
        h0, c0 = torch.zeros_like(h0), torch.zeros_like(c0)
    ref_h, ref_c = torch_states(cell, m, x, h0, c0, ln)
    out = forward.compiled_forward(cell, x, None if zero_start else h0, c0 if cell == "lstm" and not zero_start
                                   else None, *weights(m), lengths=ln, threads=threads)
    assert out is not None, native.unavailable_reason()
    h, c = out
    assert h.shape == (T, B, H) and h.dtype == dtype
    assert rel_err(h, ref_h) <= TOL[dtype], (cell, T, B, I, H, dtype, rel_err(h, ref_h))
    if cell == "lstm":
        assert rel_err(c, ref_c) <= TOL[dtype], (cell, T, B, I, H, dtype, rel_err(c, ref_c))
    else:
        assert c is None
    return h, c


@pytest.mark.parametrize("cell", CELLS)
def test_fp64_equals_torch(cell):
    check(cell, 1, 1, 12, 6, torch.float64)
    check(cell, 7, 3, 12, 6, torch.float64, bias=False)
    check(cell, 100, 17, 1, 20, torch.float64, lengths=True)
    check(cell, 1001, 16, 1, 20, torch.float64, zero_start=True)


@pytest.mark.parametrize("cell", CELLS)
def test_fp32_equals_torch(cell):
    check(cell, 7, 17, 12, 33, torch.float32, lengths=True)
    check(cell, 100, 3, 12, 33, torch.float32, bias=False)
    check(cell, 1001, 16, 1, 20, torch.float32)


@pytest.mark.parametrize("cell", CELLS)
def test_one_build_serves_every_input_size(cell):
    """The input size is the call's, not the build's: a stack's layers (I, then H) share one kernel, each exact."""
    libs = set()
    for I in (1, 2, 7, 20):
        check(cell, 9, 3, I, 6, torch.float64)
        m = layer(cell, I, 6, torch.float64, 0)
        pb = forward.problem(cell, torch.zeros(9, 3, I, dtype=torch.float64), None, None, *weights(m), None)
        libs.add(id(pb.lib))
    assert len(libs) == 1


def test_the_float_tanh_is_within_a_few_ulp_of_tanh():
    """The kernel's float tanh (simd.h's rational function, 5.4 ulp at most over every float) through the tanh RNN
    itself: no recurrence (W_hh = 0), unit i's input x scaled by 2^k (exact), so h_t = tanh(2^k x_t) rounded once
    by the kernel; held against tanh in double, in ulp of the float nearest it, and never past +-1."""
    H, T, B = 6, 2048, 16
    gen = torch.Generator().manual_seed(7)
    mag = torch.cat([torch.rand(T * B // 2, generator=gen) * 12,
                     10 ** (torch.rand(T * B // 2, generator=gen) * 9 - 8)])
    x = (mag * torch.where(torch.rand(T * B, generator=gen) < 0.5, -1.0, 1.0)).reshape(T, B, 1)
    x[-1, :4, 0] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])  # last: NaN would recur
    w_ih = 2.0 ** torch.tensor([[0.0], [1], [-1], [2], [-3], [3]])
    h, _ = forward.compiled_forward("rnn_tanh", x, None, None, w_ih, torch.zeros(H, H), None, None)
    pre = (x * w_ih[:, 0]).double()
    ref = torch.tanh(pre)
    # the ulp of the float nearest tanh, 2^(e - 24) for a float in [2^(e-1), 2^e), in double arithmetic: numpy's
    # spacing would be flushed to zero for tanh(0) where a test before this one flushes subnormals
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.float().double())[1] - 24)
    err = ((h.double() - ref).abs() / ulp)[~pre.isnan()]
    assert err.max() <= 5.4, err.max()
    assert h[~pre.isnan()].abs().max() <= 1 and h[pre.isnan()].isnan().all()
    assert h[-1, 0].eq(0).all() and h[-1, 1].eq(1).all() and h[-1, 2].eq(-1).all()


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_equals_torch_without_onednn(cell):
    """torch's other CPU kernels (the native GEMM loop) are held to the same bounds."""
    with torch.backends.mkldnn.flags(enabled=False):
        check(cell, 100, 16, 1, 20, torch.float32)
        check(cell, 100, 3, 12, 6, torch.float64)


@pytest.mark.parametrize("cell", ["rnn_tanh", "lstm"])
def test_the_same_bits_on_any_thread_and_in_any_lane(cell):
    """A batch element's states do not depend on the thread that ran its lanes, on the lane it sat in, on its
    neighbours or on the vector width: what the sliced forward's exactness rests on (its slices run elsewhere than
    the serial run, and plan_lanes narrows the lanes for more threads on AVX-512)."""
    dtype = torch.float32
    m = layer(cell, 1, 20, dtype, 3)
    x = torch.randn(50, 17, 1, dtype=dtype)
    h0, c0 = torch.randn(17, 20, dtype=dtype), torch.randn(17, 20, dtype=dtype)
    c0 = c0 if cell == "lstm" else None
    h1, c1 = forward.compiled_forward(cell, x, h0, c0, *weights(m), threads=1)
    h2, c2 = forward.compiled_forward(cell, x, h0, c0, *weights(m), threads=2)
    assert torch.equal(h1, h2) and (c1 is None or torch.equal(c1, c2))
    # nor on the build's lane count (a register, or the half of one that plan_lanes takes for more jobs)
    half = native.lane_width("forward", dtype) // 2
    h3, c3 = forward.compiled_forward(cell, x, h0, c0, *weights(m), threads=2, lanes=half)
    assert torch.equal(h1, h3) and (c1 is None or torch.equal(c1, c3))
    for b in (0, 5, 16):
        one = forward.compiled_forward(cell, x[:, b:b + 1], h0[b:b + 1], None if c0 is None else c0[b:b + 1],
                                       *weights(m))
        assert torch.equal(one[0][:, 0], h1[:, b]) and (c1 is None or torch.equal(one[1][:, 0], c1[:, b]))


def test_calls_from_several_threads_at_once():
    """Calls from several Python threads at once (the kernel's pool serves one call at a time; a call made meanwhile
    runs on its own thread) give the same bits as one alone."""
    from concurrent.futures import ThreadPoolExecutor

    m = layer("gru", 1, 20, torch.float32, 4)
    x = torch.randn(300, 24, 1)
    want = forward.compiled_forward("gru", x, None, None, *weights(m), threads=2)[0]
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda _: forward.compiled_forward("gru", x, None, None, *weights(m), threads=2)[0],
                          range(24)))
    assert all(torch.equal(g, want) for g in got)


def test_the_lanes_narrow_only_where_the_threads_want_more_jobs():
    L = native.lane_width("forward", torch.float32)
    assert forward.plan_lanes(16, torch.float32, 1) == L
    assert forward.plan_lanes(16, torch.float32, 2) == (L // 2 if L * 4 > 32 and 16 <= L else L)
    assert forward.plan_lanes(1000, torch.float32, 2) == L
    assert all(forward.plan_lanes(B, dt, p) * dt.itemsize >= min(32, L * dt.itemsize)
               for B in (1, 8, 16, 17) for dt in (torch.float32, torch.float64) for p in (1, 2, 16))


def test_unsupported_cases_return_none():
    m = torch.nn.LSTM(3, 6, proj_size=2)
    x = torch.randn(5, 2, 3)
    assert forward.compiled_forward("lstm", x, None, None, *weights(m)) is None  # proj_size > 0: torch's
    g = torch.nn.GRU(3, 6)
    assert forward.compiled_forward("gru", x.half(), None, None, *(w.half() for w in weights(g))) is None
    assert forward.compiled_forward("gru", x.to("meta"), None, None, *(w.to("meta") for w in weights(g))) is None
    with pytest.raises(ValueError, match="cell 'lstmx'"):
        forward.compiled_forward("lstmx", x, None, None, *weights(g))
    with pytest.raises(ValueError, match="w_ih must be"):
        forward.compiled_forward("gru", torch.randn(5, 2, 4), None, None, *weights(g))


def test_without_a_compiler_the_forward_is_none(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        m = torch.nn.RNN(1, 4)
        assert forward.compiled_forward("rnn_tanh", torch.randn(3, 2, 1), None, None, *weights(m)) is None
        assert "no C compiler" in native.unavailable_reason()
    finally:
        monkeypatch.undo()
        native.reset()
    assert os.environ.get("CC") != str(tmp_path / "no-such-cc")


# -- forward_until_meet: a slice rerun from its true start until it meets a stored trajectory ------------------

def bitstreams(T, B, dtype, seed=0):
    """The paper's inputs: class c ~ U{0..9}, x_t ~ Bernoulli(0.05 + 0.1 c), [T, B, 1]."""
    import numpy as np

    from bppsa.data import bitstream

    bits, y = bitstream.generate(T, B, seed=seed, progress=False)
    return bitstream.batch(bits, y, T, np.arange(B), dtype=dtype)[0]


def first_equal(new, stored, t0):
    """The first step s >= t0 from which every batch element's state in ``stored`` equals ``new`` bitwise (states
    [T, B, H]; None where some never does)."""
    same = (new[t0:] == stored[t0:]).all(-1)  # [steps, B]
    # from s on: the elements equal at s and at every step after it
    tail = same.flip(0).cumprod(0).flip(0).bool().all(-1)
    ok = tail.nonzero()
    return None if not len(ok) else t0 + int(ok[0])


def slice_case(cell, dtype, T, B, t0, t1, seed=0, lengths=None, m=None):
    """A layer that forgets (torch's init), on bitstreams: its serial forward, and the same with steps t0 .. t1 - 1
    rerun from a bad start (zeros where it was the serial state), the stored trajectory of a slice's first sweep."""
    m = m or layer(cell, 1, 20, dtype, seed)
    x = bitstreams(T, B, dtype, seed)
    h0 = torch.rand(B, 20, dtype=dtype) - 0.5
    c0 = torch.rand(B, 20, dtype=dtype) - 0.5 if cell == "lstm" else None
    h, c = forward.compiled_forward(cell, x, h0, c0, *weights(m), lengths=lengths)
    bad_h, bad_c = h.clone(), None if c is None else c.clone()
    guess = torch.zeros(B, 20, dtype=dtype)
    s = forward.forward_until_meet(cell, x, guess, guess if c is not None else None, *weights(m), t0, t1, bad_h,
                                   bad_c, stored=False, lengths=lengths)
    assert s == t1
    return m, x, h, c, bad_h, bad_c


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cell", CELLS)
def test_a_rerun_from_the_true_start_meets_where_the_trajectories_become_equal(cell, dtype):
    """Where the two trajectories become bitwise equal (the GRU, the LSTM and the relu RNN forget their start within
    ~250 steps here), the rerun stops there and the whole is the serial forward; where they never do within the
    slice, it runs to the slice's end, as exact.  (The tanh RNN's two trajectories come within an ulp of each other
    in ~100 steps but then stay an ulp apart in some coordinate for thousands of steps -- torch's own forward too,
    for hundreds to thousands: the rounded map has many states it cycles among -- so only a tolerance makes them
    meet: the next test.)"""
    T, B, t0, t1 = 700, 17, 100, 700
    m, x, h, c, bad_h, bad_c = slice_case(cell, dtype, T, B, t0, t1)
    meet = [first_equal(h, bad_h, t0)] + ([first_equal(c, bad_c, t0)] if c is not None else [])
    expect = t1 if None in meet else max(meet)
    assert expect > t0  # the guess mattered
    if cell != "rnn_tanh":
        assert expect < t1, expect  # and was forgotten
    # every stored step after the meeting is spoiled: a run that went on past it would overwrite them
    bad_h[expect + 1:] = float("nan")
    if c is not None:
        bad_c[expect + 1:] = float("nan")
    s = forward.forward_until_meet(cell, x, h[t0 - 1], None if c is None else c[t0 - 1], *weights(m), t0, t1, bad_h,
                                   bad_c)
    assert s == expect
    assert torch.equal(bad_h[:s + 1], h[:s + 1]) and bad_h[s + 1:].isnan().all()
    if c is not None:
        assert torch.equal(bad_c[:s + 1], c[:s + 1])


@pytest.mark.parametrize("cell", ["rnn_tanh", "lstm"])
def test_a_tolerance_meets_each_element_at_its_first_step_within_it(cell):
    """Per batch element, max|new - stored| <= tol * max|stored| (h and c each): each element's first such step is its
    meeting step, its states before it are the new (serial) ones and from it on the stored ones."""
    dtype, tol = torch.float64, 1e-6
    T, B, t0, t1 = 400, 5, 50, 400
    m, x, h, c, bad_h, bad_c = slice_case(cell, dtype, T, B, t0, t1)
    stored_h, stored_c = bad_h.clone(), None if c is None else bad_c.clone()

    def within(t):  # [B]
        ok = torch.ones(B, dtype=torch.bool)
        for new, old in ((h, bad_h), (c, bad_c)):
            if new is not None:
                ok &= (new[t] - old[t]).abs().amax(-1) <= tol * old[t].abs().amax(-1)
        return ok

    ok = torch.stack([within(t) for t in range(t0, t1)])  # [steps, B]
    expect = t0 + ok.to(torch.int64).argmax(0)
    assert ok.any(0).all() and (expect > t0).all()
    met = torch.empty(B, dtype=torch.int64)
    s = forward.forward_until_meet(cell, x, h[t0 - 1], None if c is None else c[t0 - 1], *weights(m), t0, t1, bad_h,
                                   bad_c, tol=tol, met=met)
    assert torch.equal(met, expect) and s == int(expect.max())
    assert s < (first_equal(h, bad_h, t0) or t1)  # before the trajectories are equal, if they ever are
    for b in range(B):
        e = int(expect[b])
        assert torch.equal(bad_h[:e, b], h[:e, b]) and torch.equal(bad_h[e:, b], stored_h[e:, b])
        if c is not None:
            assert torch.equal(bad_c[:e, b], c[:e, b]) and torch.equal(bad_c[e:, b], stored_c[e:, b])


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_sequences_that_end_inside_the_slice_carry_their_true_state(cell):
    """A sequence that ends before it meets its stored trajectory never will (both then carry a constant): its true
    carry is written to the slice's end at once (its meeting step is t1); the others meet; the whole equals the
    serial forward."""
    dtype = torch.float32
    T, B, t0, t1 = 600, 11, 100, 600
    lengths = torch.tensor([600, 50, 150, 300, 599, 1, 600, 450, 120, 600, 600])
    m, x, h, c, bad_h, bad_c = slice_case(cell, dtype, T, B, t0, t1, lengths=lengths)
    assert not torch.equal(bad_h[-1], h[-1])
    met = torch.empty(B, dtype=torch.int64)
    s = forward.forward_until_meet(cell, x, h[t0 - 1], None if c is None else c[t0 - 1], *weights(m), t0, t1, bad_h,
                                   bad_c, lengths=lengths, met=met)
    assert s == t1 and (met[lengths <= t0 + 50] == t1).all() and (met[lengths == T] < t1).all(), met
    assert torch.equal(bad_h, h) and (c is None or torch.equal(bad_c, c))


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_a_layer_that_remembers_never_meets_and_the_rerun_is_the_serial_forward(cell):
    from bppsa.bench.forward import make_layer

    dtype = torch.float64
    T, B, t0 = 500, 4, 100
    m, x, h, c, bad_h, bad_c = slice_case(cell, dtype, T, B, t0, T, m=make_layer(cell, 1, 20, dtype, "remembers"))
    assert first_equal(h, bad_h, t0) is None
    met = torch.empty(B, dtype=torch.int64)
    s = forward.forward_until_meet(cell, x, h[t0 - 1], None if c is None else c[t0 - 1], *weights(m), t0, T, bad_h,
                                   bad_c, met=met)
    assert s == T and (met == T).all() and torch.equal(bad_h, h) and (c is None or torch.equal(bad_c, c))
