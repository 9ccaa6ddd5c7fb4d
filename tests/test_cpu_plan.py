"""The CPU fast path's plans (bppsa.backends.cpu.plan): the rules, the candidates, measured at first use and kept
beside the kernels, and every plan exact."""
import json

import pytest
import torch

from bppsa import scan
from bppsa.backends.chain import GruChain, RnnChain
from bppsa.backends.cpu import native, plan
from bppsa.backends.cpu.chain import native_chain_scan, rnn_chain, synthetic

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")


@pytest.fixture
def widest(monkeypatch):
    """Plans as on a target with vectors of `bytes` bytes (whatever this machine's)."""
    def set_bytes(nbytes):
        monkeypatch.setattr(native, "lane_width", lambda kind, dtype: max(1, nbytes // dtype.itemsize))
    return set_bytes


@pytest.mark.parametrize("nbytes,B,expect", [
    (32, 16, (8, True, 2)),    # AVX2: two 8-lane slices, one per thread (a 16-lane vector does not exist)
    (64, 16, (16, False, 2)),  # AVX-512: one 16-lane slice whose blocks both threads share
    (32, 8, (8, False, 2)),    # one slice, shared by blocks
    (32, 64, (8, True, 2)),    # eight slices, four per thread
    (32, 1, (8, True, 1)),     # one element: its blocks are the lanes, on one thread (too little to split)
])
def test_the_estimate_fills_a_vector_register_per_slice(widest, nbytes, B, expect):
    widest(nbytes)
    p = plan.estimate("rnn", 1000, B, 20, torch.float32, "auto", 2)
    assert (p.lanes, p.by_slice, p.threads) == expect and p.fused == 6
    assert max(w for gr in p.groups(B) for _, w in gr) <= nbytes // 4


def test_the_sequential_rival_takes_slices_only(widest):
    widest(32)
    for B in (1, 3, 16, 64):
        assert all(pl.by_slice for pl in plan.candidates("rnn", 1000, B, 20, 0, torch.float32, "slices", 2))


@pytest.mark.parametrize("B", [1, 8, 16, 17, 64])
def test_candidates_start_with_the_estimate_and_are_pruned_by_the_model(widest, B):
    widest(32)
    L = scan.tree_levels(1001, None)
    cands = plan.candidates("rnn", 1000, B, 20, L, torch.float32, "auto", 2)
    assert cands[0] == plan.estimate("rnn", 1000, B, 20, torch.float32, "auto", 2)
    assert 1 <= len(cands) <= 6 and len(set(cands)) == len(cands)
    best = min(plan.predict("rnn", 1000, B, 20, L, c) for c in cands)
    assert all(plan.predict("rnn", 1000, B, 20, L, c) <= 1.6 * best for c in cands[1:])
    # the model sees a thread left idle: two threads sharing the work beat one where B allows it
    one = plan.Plan(8, True, 1, 1, 6)
    assert plan.predict("rnn", 1000, 16, 20, L, plan.Plan(8, True, 2, 1, 6)) < plan.predict("rnn", 1000, 16, 20, L, one)


def test_bad_plan_mode_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("BPPSA_PLAN", "guess")
    with pytest.raises(ValueError, match="BPPSA_PLAN='guess'.*measure, estimate"):
        plan.mode()


def test_a_plan_is_measured_once_stored_beside_the_kernels_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("BPPSA_PLAN", "measure")
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(plan, "_chosen", {})
    calls = []
    real = plan._measure

    def counted(*a):
        calls.append(a)
        return real(*a)

    monkeypatch.setattr(plan, "_measure", counted)
    shape = ("rnn", 300, 16, 20, 1, torch.float32, 9, "auto", True, 2, lambda: synthetic("rnn", 300, 16, 20, 1,
                                                                                       torch.float32))
    p = plan.choose(*shape)
    assert len(calls) == 1 and p.source == "measured"
    (store,) = (tmp_path / "plans").glob("*.json")
    key = f"rnn n=300 B=16 H=20 I=1 float32 L=9 auto grads=1 threads=2 v{plan.STORE_VERSION}"
    entry = json.loads(store.read_text())[key]
    assert entry["plan"]["lanes"] == p.lanes and len(entry["candidates"]) >= 2
    assert all(c["median_ms"] > 0 and c["rounds"] >= 3 for c in entry["candidates"])
    assert plan.choose(*shape) == p and len(calls) == 1  # this process: remembered
    monkeypatch.setattr(plan, "_chosen", {})  # another process: read from the store, not measured again
    assert plan.choose(*shape) == p and len(calls) == 1
    monkeypatch.setenv("BPPSA_PLAN", "estimate")  # estimate: never measured
    assert plan.choose(*shape).source == "estimate" and len(calls) == 1
    monkeypatch.setenv("BPPSA_PLAN", "measure")  # nothing to measure on: the estimate
    assert plan.choose(*shape[:-1]) == plan.estimate("rnn", 300, 16, 20, torch.float32, "auto", 2)


@pytest.mark.parametrize("nbytes,B,threads,expect", [
    (32, 16, 2, 0),     # two 8-lane slices, one per thread: the linear scan
    (64, 4, 2, 0),      # two 2-lane slices: each thread has one
    (32, 1, 2, None),   # one element, two threads: the linear scan would leave one idle, the tree shares its blocks
    (32, 1, 1, 0),      # one thread: nothing for the tree's extra work to buy
    (32, 3, 4, None),   # three slices for four threads
])
def test_the_auto_depth_is_linear_where_the_slices_fill_the_threads(widest, nbytes, B, threads, expect):
    widest(nbytes)
    for kind in ("rnn", "gru", "lstm"):
        assert plan.auto_levels(kind, B, torch.float32, threads) == expect


def test_a_damaged_plan_store_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("BPPSA_PLAN", "measure")
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(plan, "_chosen", {})
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / f"{native.build_key()}.json").write_text("{not json")
    p = plan.choose("rnn", 100, 3, 20, 1, torch.float64, 7, "auto", False, 2,
                    lambda: synthetic("rnn", 100, 3, 20, 1, torch.float64))
    assert p in plan.candidates("rnn", 100, 3, 20, 7, torch.float64, "auto", 2) or p.source == "measured"
    assert json.loads((tmp_path / "plans" / f"{native.build_key()}.json").read_text())


@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("B", [1, 16, 17])
def test_every_candidate_plan_gives_the_reference_scan_and_gradients(kind, B, monkeypatch):
    """Whichever candidate the measuring picks, the scan is the reference tree's and the parameter gradients
    agree with the estimate's (to rounding: slices and parts sum in another order)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    n, H, I = 333, 20, (12 if kind == "gru" else 1)
    g = torch.Generator().manual_seed(B)
    if kind == "rnn":
        W = torch.randn(H, H, generator=g, dtype=torch.float64) * 0.3
        chain = rnn_chain(RnnChain, torch.rand(n, B, H, generator=g, dtype=torch.float64) * 1.8 - 0.9, W,
                          torch.rand(n, B, I, generator=g, dtype=torch.float64))
    else:
        W = torch.randn(3 * H, H, generator=g, dtype=torch.float64) * 0.3
        chain = GruChain(W, torch.rand(n, 6 * H + I, B, generator=g, dtype=torch.float64) * 0.5, I)
    gT = torch.randn(B, H, generator=g, dtype=torch.float64)
    L = scan.tree_levels(n + 1, None)
    ref_scan = scan.blelloch_scan(gT, chain.dense())
    grads_ref = None
    for p in plan.candidates(kind, n, B, H, L, torch.float64, "auto", 2):
        monkeypatch.setattr(plan, "choose", lambda *a, _p=p: _p)
        got = native_chain_scan(gT, chain, L, scan.Workspace())
        assert ((got - ref_scan).abs().max() / ref_scan.abs().max()).item() <= 1e-12, p
        grads = native_chain_scan(gT, chain, L, scan.Workspace(), grads=True)
        grads_ref = grads_ref or grads
        for name, v in grads.items():
            assert ((v - grads_ref[name]).abs().max() / grads_ref[name].abs().max()).item() <= 1e-12, (p, name)


@pytest.mark.parametrize("kind", ["rnn", "gru"])
@pytest.mark.parametrize("B", [1, 8, 16])
def test_a_unit_run_again_for_a_held_up_thread_changes_no_bit(kind, B, monkeypatch):
    """A thread that finds a unit's thread off its core runs the unit itself (native.Team): with a stall time of
    0 every wait does so, and the scan and the parameter gradients are still bit for bit those of the plain
    team, for every candidate plan (and the per-step gradients' affine scan)."""
    n, H, I = 333, 20, (12 if kind == "gru" else 1)
    chain, gT = synthetic(kind, n, B, H, I, torch.float64)
    L = scan.tree_levels(n + 1, None)
    src = chain.states if chain.states is not None else chain._f
    c = torch.randn(n, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reruns = 0
    for p in plan.candidates(kind, n, B, H, L, torch.float64, "auto", 2):
        for grads, affine in ((False, False), (True, False), (False, True)):
            got = []
            for stall in (None, 0):
                team = plan._team(chain, L, p, grads, affine)
                if stall is not None:
                    team.t.stall_ns = stall
                for _ in range(5 if stall is not None else 1):
                    out = None if grads else torch.empty((n, B, H), dtype=torch.float64)
                    r = team.go(chain._W, src, gT, out, direct=c if affine else None)
                    got.append(r if grads else out)
                reruns += team.t.reruns
            for r in got[1:]:
                if grads:
                    assert all(torch.equal(r[k], got[0][k]) for k in r), (p, grads)
                else:
                    assert torch.equal(r, got[0]), (p, affine)
    multi = [pl for pl in plan.candidates(kind, n, B, H, L, torch.float64, "auto", 2) if pl.threads > 1]
    if multi:  # the test ran what it is about; a busy host can let one thread finish before another waits: retry
        want = torch.empty((n, B, H), dtype=torch.float64)
        plan._team(chain, L, multi[0], False).go(chain._W, src, gT, want)
        team = plan._team(chain, L, multi[0], False)
        team.t.stall_ns = 0
        for _ in range(500):
            if reruns or team.t.reruns:
                break
            out = torch.empty((n, B, H), dtype=torch.float64)
            team.go(chain._W, src, gT, out)
            assert torch.equal(out, want)
        assert reruns + team.t.reruns > 0


def test_a_forked_child_runs_the_parents_team(monkeypatch):
    """The call may return while a held-up thread is still inside it (native.Team); a child forked then has none
    of the parent's threads, and its first call must not wait for them."""
    import multiprocessing as mp

    n, B, H = 200, 16, 20
    chain, gT = synthetic("rnn", n, B, H, 1, torch.float64)
    L = scan.tree_levels(n + 1, None)
    p = plan.Plan(native.lane_width("rnn", torch.float64), True, 2, 4, 5)
    team = plan._team(chain, L, p, True)
    ref = team.go(chain._W, chain.states, gT)
    team.t.inside = 1  # as if a straggler of the parent's last call were still inside

    def child(q):
        got = team.go(chain._W, chain.states, gT)
        q.put(all(torch.equal(got[k], ref[k]) for k in ref))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=child, args=(q,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and q.get(timeout=5)
    team.t.inside = 0


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_chains_with_a_gate_pass_are_planned_on_all_the_threads(widest, kind):
    """The team of a GRU's or an LSTM's scan also writes the chain's factors, on all of its threads; the synthetic
    chains the plans are timed on hold none of that work, so no plan of fewer threads competes (one thread's 16 lanes
    once won the timing by 7 % and made the layer's backward 1.35x slower)."""
    widest(64)
    for B in (16, 32, 64):
        cands = plan.candidates(kind, 1000, B, 20 if kind == "gru" else 40, 0, torch.float32, "auto", 2)
        assert len(cands) >= 1 and all(pl.threads == 2 for pl in cands[1:]), cands
