"""BPPSA across processes: the ranks' scan (bppsa.distributed.rank_scan) in real gloo process groups on 127.0.0.1.

One spawn of p ranks runs every case for that p (a spawn costs a torch import per rank; a case costs
milliseconds), and hands back what each rank measured; the assertions run here.
"""
from __future__ import annotations

import sys

import pytest
import torch

from bppsa.distributed import RankFailure, compose, default_strategy, local_carries, rank_scan
from bppsa.distributed.launch import LaunchError, _first_node, launcher_env, run_local
from bppsa.distributed.rank_scan import NAMING_WINDOW_S

# one worker takes the whole file (--dist loadgroup): the spawn of four gloo ranks (four_ranks) is made once
pytestmark = pytest.mark.xdist_group("test_distributed")
SCAN_CASES = [(dense, reverse, strategy, initial, batch)
              for dense in (True, False) for reverse in (False, True) for strategy in ("rounds", "allgather")
              for initial in (False, True) for batch in ((3,), (2, 2))]


def _summaries(p: int, dense: bool, batch: tuple, seed: int, dtype=torch.float64):
    """Every rank's (M, c), the same on every rank (each builds them all and keeps its own)."""
    gen = torch.Generator().manual_seed(seed)
    H = 5
    if dense:
        M = torch.randn((p,) + batch + (H, H), generator=gen, dtype=dtype) / H ** 0.5
    else:
        M = torch.rand((p,) + batch + (H,), generator=gen, dtype=dtype) * 1.5 - 0.75
    c = torch.randn((p,) + batch + (H,), generator=gen, dtype=dtype)
    x0 = torch.randn(batch + (H,), generator=gen, dtype=dtype)
    return M, c, x0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# The exchanges' timeout in the tests that are not about faults: a rank's first use of a CPU kernel builds it (a C
# compile under a lock shared by the ranks, ~1-2 s, several per suite), and on a loaded 2-core machine with an empty
# cache a peer waited more than 60 s for one (reproduced with a compiler slowed by 4 s a build); the fault tests keep
# their own short FAULT_TIMEOUT.
GROUP_TIMEOUT = 240


def scan_suite(rank: int, p: int, group) -> list[tuple]:
    """Every SCAN_CASES case on this rank: (case, relative error against the sequential reference)."""
    out = []
    for i, (dense, reverse, strategy, initial, batch) in enumerate(SCAN_CASES):
        M, c, x0 = _summaries(p, dense, batch, seed=100 + i)
        ref = local_carries(M, c, x0 if initial else None, reverse=reverse)
        got = rank_scan(M[rank], c[rank], group, reverse=reverse, strategy=strategy,
                        initial=x0 if initial else None, timeout=GROUP_TIMEOUT)
        out.append(((dense, reverse, strategy, initial, batch), _rel(got, ref[rank]), tuple(got.shape)))
    return out


# (cell, T, num_layers, lengths, h0, dx, steps, backend, dtype): T not divisible by most p; a loss on h_n, and with
# ``steps`` on every step too (without: the single seed on every rank, the paper's loss)
LAYER_CASES = [("rnn", 7, 1, False, True, True, True, "torch", torch.float64),
               ("gru", 7, 1, False, False, True, True, "cpu", torch.float64),
               ("rnn", 10, 2, True, True, True, True, "cpu", torch.float64),
               ("gru", 10, 2, True, True, False, True, "torch", torch.float64),
               ("rnn", 9, 1, True, False, False, True, "cpu", torch.float32),
               ("gru", 11, 1, False, True, True, True, "cpu", torch.float32),
               # no lengths, h0 or ∇x: rank 0's weights' gradients summed by the CPU kernel as it scans
               ("rnn", 10, 1, False, False, False, True, "cpu", torch.float64),
               ("gru", 9, 1, False, False, False, True, "cpu", torch.float64),
               ("rnn", 11, 1, False, False, False, False, "cpu", torch.float64),
               ("gru", 10, 1, True, False, True, False, "cpu", torch.float64),
               ("rnn", 9, 1, False, True, False, False, "torch", torch.float64),
               ("gru", 11, 1, False, False, False, False, "cpu", torch.float32),
               # the LSTM's state (h, c) crosses the ranks; relu's Jacobians
               ("lstm", 10, 2, True, True, True, True, "cpu", torch.float64),
               ("lstm", 11, 1, False, False, False, True, "cpu", torch.float64),
               ("lstm", 9, 1, False, True, True, False, "torch", torch.float32),
               ("rnn_relu", 10, 1, True, True, True, True, "cpu", torch.float64)]
LAYERS = {"rnn": ("RNN", {}), "rnn_relu": ("RNN", {"nonlinearity": "relu"}), "gru": ("GRU", {}), "lstm": ("LSTM", {})}


def _finals(h_n):
    """h_n, or an LSTM's (h_n, c_n) as one tensor [2 num_layers, B, H] (what the loss weighs)."""
    return torch.cat(list(h_n)) if isinstance(h_n, tuple) else h_n


def _reference(model, x, h0, lengths, w_out, w_hn):
    """torch.nn's layer by autograd on the whole sequence (a PackedSequence for lengths): outputs and gradients."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    ref = model.to_torch()
    x = x.detach().requires_grad_()
    h0 = None if h0 is None else h0.detach().requires_grad_()
    hx = h0 if h0 is None or model.cell.cell_state is False else (h0[:h0.shape[0] // 2], h0[h0.shape[0] // 2:])
    if lengths is None:
        out, h_n = ref(x, hx)
    else:
        out, h_n = ref(pack_padded_sequence(x, lengths, enforce_sorted=False), hx)
        out, _ = pad_packed_sequence(out, total_length=x.shape[0])
    ((out * w_out).sum() + (_finals(h_n) * w_hn).sum()).backward()
    grads = {n: q.grad for n, q in ref.named_parameters()}
    return out.detach(), _finals(h_n).detach(), grads, x.grad, (h0.grad if h0 is not None else None)


def layer_suite(rank: int, p: int, group) -> list[tuple]:
    """Every LAYER_CASES case: this rank's slice through the split layer against torch.nn autograd on the whole
    sequence and against the single-process layer; (case, {what: relative error})."""
    import bppsa.nn as bnn
    import bppsa.nn.backward as bw
    import bppsa.nn.split as split_mod

    out = []
    blocks = bw.GRAD_BLOCK_VALUES, split_mod.SUMMARY_BLOCK_VALUES
    for i, (cell, T, layers, with_lengths, with_h0, with_dx, steps, backend, dtype) in enumerate(LAYER_CASES):
        # every other case: a slice's gradients and its map one step at a time (the blocks of long slices)
        bw.GRAD_BLOCK_VALUES, split_mod.SUMMARY_BLOCK_VALUES = (1, 1) if i % 2 else blocks
        gen = torch.Generator().manual_seed(500 + i)
        B, I, H = 3, 2, 6  # test_nn.py's hidden size: the CPU kernels are built once for both
        name, kw = LAYERS[cell]
        cls = getattr(bnn, name)
        torch.manual_seed(7 + i)
        single = cls(I, H, num_layers=layers, backend=backend, dtype=dtype, **kw)
        pg = group if group is not None else torch.distributed.group.WORLD
        split = cls(I, H, num_layers=layers, backend=backend, dtype=dtype, process_group=pg,
                    group_timeout=GROUP_TIMEOUT, **kw)
        split.load_state_dict(single.state_dict())
        n = 2 if single.cell.cell_state else 1  # h0 (and c0), stacked
        x = torch.randn(T, B, I, generator=gen, dtype=dtype)
        h0 = torch.randn(n * layers, B, H, generator=gen, dtype=dtype) if with_h0 else None
        lengths = torch.tensor([T, 1, max(1, T - 3)]) if with_lengths else None
        w_out = torch.randn(T, B, H, generator=gen, dtype=dtype) * steps
        w_hn = torch.randn(n * layers, B, H, generator=gen, dtype=dtype)

        def states(t, n=n, layers=layers):
            return t if t is None or n == 1 else (t[:layers], t[layers:])

        # this rank's slice, torch.tensor_split order
        sl = torch.tensor_split(torch.arange(T), p)[rank]
        xs = x[sl].clone().requires_grad_(with_dx)
        hs = h0.clone().requires_grad_() if h0 is not None else None
        o, hn = split(xs, states(hs), lengths=lengths)
        hn = _finals(hn)
        loss = (o * w_out[sl]).sum() + ((hn * w_hn).sum() if rank == p - 1 else 0)
        loss.backward()
        r_out, r_hn, r_grads, r_dx, r_dh0 = _reference(single, x, h0, lengths, w_out, w_hn)
        err = {"out": _rel(o.detach(), r_out[sl])}
        if rank == p - 1:
            err["h_n"] = _rel(hn.detach(), r_hn)
        for name, q in split.named_parameters():
            err[name] = _rel(q.grad, r_grads[name])
        if with_dx:
            err["dx"] = _rel(xs.grad, r_dx[sl])
        if with_h0 and rank == 0:
            err["dh0"] = _rel(hs.grad, r_dh0)
        # the single-process layer, the same loss
        for q in single.parameters():
            q.grad = None
        so, shn = single(x, states(h0), lengths=lengths)
        ((so * w_out).sum() + (_finals(shn) * w_hn).sum()).backward()
        err["vs_single"] = max(_rel(q.grad, s.grad) for q, s in zip(split.parameters(), single.parameters()))
        out.append(((cell, T, layers, with_lengths, with_h0, with_dx, steps, backend, str(dtype)), err))
    bw.GRAD_BLOCK_VALUES, split_mod.SUMMARY_BLOCK_VALUES = blocks
    return out


def _remembering(layer) -> None:
    """Weights under which the layer remembers (its trajectories from two starts never meet): the LSTM's forget
    gate held open, the GRU's update gate held shut (h_t ~ h_{t-1}), the RNN's recurrence a near-orthogonal map."""
    with torch.no_grad():
        for k in range(layer.num_layers):
            w_hh, b_hh = getattr(layer, f"weight_hh_l{k}"), getattr(layer, f"bias_hh_l{k}")
            H = layer.hidden_size
            if layer.cell.name == "lstm":
                b_hh[H:2 * H] = 20.0
            elif layer.cell.name == "gru":
                b_hh[H:2 * H] = 20.0
            else:
                q, _ = torch.linalg.qr(torch.randn(H, H, dtype=w_hh.dtype))
                w_hh.copy_(0.999 * q)
                getattr(layer, f"weight_ih_l{k}").mul_(1e-3)


def forward_suite(rank: int, p: int, group) -> list[tuple]:
    """The forward across the ranks (bppsa.nn.split.ranks_forward) against the single-process layer's forward, for
    each cell, layers that forget (torch's init) and that remember, lengths ending inside a slice, parallel_forward
    True (the sweeps; twice: zeros, then the last call's starts as the guesses, on other inputs; then a step more,
    which changes some ranks' slices and not others), None (where it pays) and False (the serial hand-off): (case,
    whether every call's states and h_n equal the single process's (bit for bit where the cell meets bitwise), the
    sweeps of each call)."""
    import bppsa.nn as bnn

    out = []
    pg = group if group is not None else torch.distributed.group.WORLD
    for cell, kw in (("RNN", {}), ("GRU", {}), ("LSTM", {})):
        for remembers in (False, True):
            for mode in (True, None, False):
                torch.manual_seed(3)
                single = getattr(bnn, cell)(2, 6, backend="cpu", dtype=torch.float64, **kw)
                if remembers:
                    _remembering(single)
                split = getattr(bnn, cell)(2, 6, backend="cpu", dtype=torch.float64, process_group=pg,
                                           parallel_forward=mode, group_timeout=GROUP_TIMEOUT, **kw)
                split.load_state_dict(single.state_dict())
                gen = torch.Generator().manual_seed(4)
                exact, sweeps = True, []
                for T in (403, 403, 404):
                    lengths = torch.tensor([T, 250, 7])
                    sl = torch.tensor_split(torch.arange(T), p)[rank]
                    x = (torch.rand(T, 3, 2, generator=gen, dtype=torch.float64) < 0.4).double()
                    with torch.no_grad():
                        want, want_n = single(x, lengths=lengths)
                        got, got_n = split(x[sl], lengths=lengths)
                    same = torch.equal if split.cell.meet_ulps == 0 else (lambda a, b: _rel(a, b) <= 1e-12)
                    exact = exact and same(got, want[sl])
                    if rank == p - 1:
                        exact = exact and same(torch.cat(list(got_n)) if isinstance(got_n, tuple) else got_n,
                                               torch.cat(list(want_n)) if isinstance(want_n, tuple) else want_n)
                    stats = split.forward_stats[0]
                    sweeps.append(None if stats is None else stats["sweeps"])
                out.append(((cell, remembers, mode), exact, sweeps))
    return out


def collectives_suite(rank: int, p: int, group) -> dict:
    """The collectives one call of a 2-layer split LSTM with lengths (torch's init: it forgets) makes on this rank,
    counted by kind: {name: calls}."""
    import bppsa.nn as bnn
    from bppsa.nn import split

    counts: dict = {}
    real = {n: getattr(split._dist, n) for n in ("all_gather_ints", "all_reduce_sum", "send_to", "recv_from")}

    def counting(name):
        def call(*args, **kw):
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kw)
        return call

    torch.manual_seed(5)
    layer = bnn.LSTM(2, 6, num_layers=2, backend="cpu", dtype=torch.float64, group_timeout=GROUP_TIMEOUT,
                     process_group=group if group is not None else torch.distributed.group.WORLD)
    T = 403
    x, lengths = torch.rand(T, 3, 2, dtype=torch.float64), torch.tensor([T, 250, 7])
    for name in real:
        setattr(split._dist, name, counting(name))
    try:
        with torch.no_grad():
            layer(x[torch.tensor_split(torch.arange(T), p)[rank]], lengths=lengths)
    finally:
        for name, fn in real.items():
            setattr(split._dist, name, fn)
    return counts


SUITES = {"scan": scan_suite, "layers": layer_suite, "forward": forward_suite, "collectives": collectives_suite}

# The groups of 4 spawned ranks the suites run in: p -> global ranks (None: the default group of all 4).  Groups
# that skip ranks make the group's ranks differ from the global ones, which the exchanges must translate.
GROUPS = {1: [2], 2: [1, 3], 3: [1, 2, 3], 4: None}


def member_groups(groups: dict, rank: int):
    """``(p, group, rank in it)`` for each group of ``groups`` (p -> global ranks; None: the default group) that
    ``rank`` belongs to; every rank creates every group, as torch.distributed requires."""
    import torch.distributed as dist

    for p, ranks in groups.items():
        group = dist.new_group(ranks) if ranks is not None else None
        if ranks is None or rank in ranks:
            yield p, group, dist.get_rank(group)


def worker(rank: int, world: int, suites: tuple[str, ...]) -> dict:
    """On each of the 4 ranks: every suite in every group of GROUPS this rank belongs to, {p: {suite: result}}."""
    return {p: {name: SUITES[name](r, p, group) for name in suites} for p, group, r in member_groups(GROUPS, rank)}


@pytest.fixture(scope="module")
def four_ranks():
    """One spawn of 4 gloo ranks running every suite in every group (the spawn is the cost; a case is cheap)."""
    return run_local(worker, 4, (tuple(SUITES),), timeout=300)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_rank_scan_is_the_sequential_scan_across_real_processes(four_ranks, p):
    members = [res[p] for res in four_ranks if p in res]
    assert len(members) == p  # every member of the group reported
    for rank, res in enumerate(members):
        cases = res["scan"]
        assert len(cases) == len(SCAN_CASES)
        for case, err, shape in cases:
            assert shape == case[4] + (5,)
            assert err <= 1e-12, (rank, case, err)


def test_local_carries_is_the_recurrence_step_by_step():
    M, c, x0 = _summaries(4, True, (2,), seed=1)
    out = local_carries(M, c, x0)
    x = x0
    for r in range(4):
        assert torch.equal(out[r], x)
        x = (M[r] @ x.unsqueeze(-1)).squeeze(-1) + c[r]
    rev = local_carries(M, c, x0, reverse=True)
    assert torch.equal(rev[3], x0)
    assert torch.allclose(rev[2], (M[3] @ x0.unsqueeze(-1)).squeeze(-1) + c[3])
    # the composition is the one the ranks use: applying (M2, c2) o (M1, c1) is applying M1 then M2
    (A, b) = compose((M[1], c[1]), (M[0], c[0]))
    assert torch.allclose((A @ x0.unsqueeze(-1)).squeeze(-1) + b, local_carries(M, c, x0)[2])


def test_rank_scan_refuses_bad_operands_before_any_exchange():
    with pytest.raises(ValueError, match="M must be"):
        rank_scan(torch.zeros(2, 4, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="must agree"):
        rank_scan(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="not initialised"):
        rank_scan(torch.zeros(2, 4, 4), torch.zeros(2, 4))
    assert default_strategy(2) in ("rounds", "allgather") and default_strategy(64) == "rounds"
    assert issubclass(RankFailure, RuntimeError) and issubclass(LaunchError, RuntimeError)


def test_launcher_env_reads_torchrun_and_slurm():
    assert launcher_env({}) is None
    tr = launcher_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert tr == {"via": "torchrun", "rank": 1, "world_size": 2, "local_rank": 1, "master_addr": "h", "master_port": 7}
    assert launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # a batch script, not an srun task
    sl = launcher_env({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "12",
                       "SLURM_JOB_NODELIST": "node[07-09],gpu1"})
    assert sl["via"] == "srun" and sl["rank"] == 3 and sl["world_size"] == 4 and sl["master_addr"] == "node07"
    assert sl["master_port"] == 20012
    assert _first_node("a,b") == "a" and _first_node("gpu7,node[01-04]") == "gpu7"


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_split_layers_equal_autograd_on_the_whole_sequence(four_ranks, p):
    """bppsa.nn.RNN/GRU/LSTM with process_group: every rank's outputs, the all-reduced weight gradients, its slice
    of ∇x and rank 0's ∇h0 (and ∇c0) equal torch.nn's autograd on the whole sequence (fp64 <= 1e-10, fp32 <= 1e-4)
    and the single-process layer's: T not divisible by p, lengths, two layers, a loss at every step and on h_n
    (and c_n)."""
    _check_layer_results([res[p]["layers"] for res in four_ranks if p in res], p)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_the_forward_across_ranks_is_the_serial_forward(four_ranks, p):
    """Every rank's states (and the last rank's h_n) equal the single process's bit for bit, by the sweeps and by
    the serial hand-off, in every call (the tanh RNN, which meets within two ulps, within 1e-12); at most one sweep per
    rank; parallel_forward=True always sweeps, False never; None sweeps in its first call of a shape, and after a
    call that did not pay (a layer that remembers) runs the serial hand-off; every call runs the same sweeps on
    every rank, also where it changes some ranks' slices only (a rank that decided alone would sweep while the others
    hand off, and the exchanges would not pair); a layer that forgets ends its first call in two sweeps at two ranks
    (sweep 0 and one correction, its rerun meeting)."""
    members = [res[p]["forward"] for res in four_ranks if p in res]
    assert len(members) == p
    for case_on_ranks in zip(*members):
        assert len({str(sweeps) for _, _, sweeps in case_on_ranks}) == 1, (p, case_on_ranks)
    for rank, cases in enumerate(members):
        for (cell, remembers, mode), exact, sweeps in cases:
            case = (p, rank, cell, remembers, mode, sweeps)
            assert exact, case
            if mode is False or p == 1:
                assert sweeps == [None, None, None], case
                continue
            assert sweeps[0] is not None and 1 <= sweeps[0] <= p, case
            if mode is True:
                assert all(n is not None and 1 <= n <= p for n in sweeps[1:]), case
            if remembers:  # never met: the first call did not pay
                assert mode is True or sweeps[1] is None, case
            elif p == 2:  # (whether it paid: fp64 meets after ~100-200 steps, about half a slice here)
                assert sweeps[0] == 2, case


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_a_call_of_a_split_stack_gathers_once(four_ranks, p):
    """One all-gather a call for the whole stack (the slices' sizes, each layer's record, the steps before this
    rank's), with lengths and two layers; at two ranks no vote, and one exchange per layer."""
    members = [res[p]["collectives"] for res in four_ranks if p in res]
    assert len(members) == p
    for rank, counts in enumerate(members):
        assert counts.get("all_gather_ints") == 1, (p, rank, counts)
        if p == 2:
            assert "all_reduce_sum" not in counts and counts["send_to" if rank == 0 else "recv_from"] == 2, counts


def _check_layer_results(members: list, p: int) -> None:
    """Each of the p ranks' layer_suite results (in rank order) within the dtype's tolerance."""
    assert len(members) == p
    for rank, layers in enumerate(members):
        assert len(layers) == len(LAYER_CASES)
        for case, err in layers:
            tol = 1e-10 if case[-1] == "torch.float64" else 1e-4
            assert "weight_hh_l0" in err and ("h_n" in err) == (rank == p - 1)
            bad = {k: v for k, v in err.items() if not v <= tol}
            assert not bad, (p, rank, case, bad)


TORCHRUN_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from bppsa.distributed.launch import init_from_env
from test_distributed import layer_suite
info = init_from_env("gloo", timeout=120)
torch.set_num_threads(1)
res = layer_suite(info["rank"], info["world_size"], None)
with open(f"{sys.argv[2]}/rank{info['rank']}.json", "w") as f:
    json.dump(res, f)
# PyTorch's shutdown pattern: every rank past its last exchange, then the group torn down (init_from_env would do
# the latter at exit)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def test_split_layers_under_torchrun_equal_autograd(tmp_path):
    """The same cases (the split LSTM's among them) launched as users launch them: `torchrun --standalone
    --nproc-per-node 3`, each rank joining the group through init_from_env (RANK, WORLD_SIZE, MASTER_ADDR/PORT), its
    gradients held to autograd's and the single process's, and every rank exiting 0 (an abort at interpreter
    shutdown fails a torchrun or SLURM job as any error does)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ranks.py"
    script.write_text(TORCHRUN_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        str(script), str(Path(__file__).parent), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    members = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(3)]
    _check_layer_results([[(tuple(case), err) for case, err in m] for m in members], 3)


def held_layers_worker(rank: int, p: int) -> dict:
    """Split layers and their outputs still held, as a script's globals are, when the group is destroyed: whether
    the group outlived destroy_process_group (before the layers held it weakly it did, gloo's threads with it, and
    a rank could abort at interpreter shutdown), and what a held layer says when called after."""
    import os
    import weakref

    import torch.distributed as dist

    import bppsa.nn as bnn

    world = weakref.ref(dist.group.WORLD)
    held = []
    for cls in (bnn.RNN, bnn.GRU):
        layer = cls(2, 6, dtype=torch.float64, process_group=dist.group.WORLD, group_timeout=GROUP_TIMEOUT)
        out, h_n = layer(torch.randn(2, 3, 2, dtype=torch.float64))
        (out.sum() + h_n.sum()).backward()
        held.append((layer, out, h_n))
    dist.barrier()
    dist.destroy_process_group()
    threads = []
    for t in os.listdir("/proc/self/task"):
        try:
            threads.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    try:
        held[0][0](torch.randn(2, 2, 2, dtype=torch.float64))
        after = None
    except Exception as exc:  # noqa: BLE001 - what the test reads
        after = f"{type(exc).__name__}: {exc}"
    return {"alive": world() is not None, "gloo_threads": [t for t in threads if "gloo" in t], "after": after}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_destroy_process_group_ends_the_group_while_split_layers_are_held():
    for res in run_local(held_layers_worker, 2, timeout=120):
        assert not res["alive"] and res["gloo_threads"] == [], res
        assert res["after"] is not None and res["after"].startswith("RuntimeError") and "destroyed" in res["after"], res


def tensor_worker(rank: int, p: int) -> dict:
    return {"rank": rank, "t": torch.arange(3, dtype=torch.float64) + rank}


def test_run_local_hands_back_tensors_by_value():
    """A rank's tensors come back as plain memory (torch.save bytes), not as shared memory that the rank's exit
    could take away before the parent reads it."""
    out = run_local(tensor_worker, 2, timeout=120)
    for r, res in enumerate(out):
        assert res["rank"] == r and torch.equal(res["t"], torch.arange(3, dtype=torch.float64) + r)
        assert not res["t"].is_shared()


FAULT_TIMEOUT = 4.0  # seconds: the group_timeout the fault test's layers run with


def fault_worker(rank: int, p: int, fault: str, victim: int, out_dir: str) -> dict:
    """A split RNN on 3 ranks whose rank ``victim`` dies (``os._exit``) or hangs as its backward starts; the
    others report the error they raised and how long after the backward began; a rank that finishes writes its
    result file (atomically, as every output of the package)."""
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    import bppsa.nn as bnn
    from bppsa.io import write_text

    torch.manual_seed(0)
    rnn = bnn.RNN(2, 4, backend="torch", process_group=dist.group.WORLD, group_timeout=FAULT_TIMEOUT)
    x = torch.randn(9, 3, 2)[torch.tensor_split(torch.arange(9), p)[rank]]
    out, _ = rnn(x)
    if rank == victim:
        out.register_hook(lambda g: os._exit(3) if fault == "die" else time.sleep(2 * FAULT_TIMEOUT))
    start = time.monotonic()
    try:
        out.square().sum().backward()
    except Exception as exc:  # noqa: BLE001 - what the test reads
        return {"error": f"{type(exc).__name__}: {exc}", "after": time.monotonic() - start,
                "rank_attr": getattr(exc, "rank", None)}
    write_text(Path(out_dir) / f"rank{rank}.txt", repr(rnn.weight_hh_l0.grad.tolist()))
    return {"error": None, "after": time.monotonic() - start}


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_rank_dying_or_hanging_mid_backward_stops_the_others_naming_it(tmp_path, fault):
    """Rank 1 of 3 dies or hangs as its backward starts: ranks 0 and 2 raise RankFailure naming rank 1 within
    the stated timeout (group_timeout, plus the window in which the live ranks name the missing one), and no
    result file is written."""
    res = run_local(fault_worker, 3, (fault, 1, str(tmp_path)), timeout=2 * FAULT_TIMEOUT + 30,
                    allow_failure=True)
    victim = res[1]  # died: run_local's "rank 1 exited"; hung: it woke to find the others gone, and failed too
    assert ("rank 1" in victim) if isinstance(victim, str) else victim["error"], victim
    for rank in (0, 2):
        got = res[rank]
        assert isinstance(got, dict) and got["error"], (rank, got)
        assert got["error"].startswith("RankFailure") and "rank 1 " in got["error"], (rank, got["error"])
        assert got["rank_attr"] == 1
        assert got["after"] <= FAULT_TIMEOUT + NAMING_WINDOW_S + 1.0, (rank, got["after"])
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary


@pytest.mark.parametrize("cell, kernel", [("rnn", True), ("rnn", False), ("rnn_relu", False), ("gru", False),
                                          ("lstm", False)])
def test_a_slices_map_equals_its_dense_chains_composition(cell, kernel, monkeypatch):
    """slice_map (a middle rank's up-sweep: the RNN's by the compiled kernel's product of the whole slice where its
    sequences all run, else torch: segments composed side by side, from the RNN's factors or the dense chain of the
    GRU and the LSTM, a tree over the segments, the steps left over one by one, block after block) against the
    whole dense chain composed by chain_summary's tree, fp64, at lengths with and without whole segments and blocks,
    with and without per-step gradients and ended sequences, the blocks as the code sizes them, of one step, and of
    40."""
    import bppsa.nn.split as split_mod
    from bppsa.backends.cpu import CpuBackend, native
    from bppsa.nn.backward import Plan
    from bppsa.nn.cells import CELLS, Saved, Weights

    calls = []
    cpu = CpuBackend()
    if kernel:
        if not native.available():
            pytest.skip(f"the CPU kernel is unavailable: {native.unavailable_reason()}")
        product = cpu.chain_product
        monkeypatch.setattr(cpu, "chain_product", lambda *a: calls.append(1) or product(*a))
    else:
        monkeypatch.setattr(cpu, "chain_product", lambda *a: None)  # the torch twin

    c_ = CELLS[cell]
    dt, B, H, I = torch.float64, 3, 6, 2
    S = c_.state_size(Weights(torch.zeros(c_.gates * H, I), torch.zeros(c_.gates * H, H)))
    gen = torch.Generator().manual_seed(11)
    worst = 0.0
    for T in (1, 15, 16, 37, 333):
        x = torch.randn(T, B, I, dtype=dt, generator=gen)
        w = Weights(*(torch.randn(c_.gates * H, k, dtype=dt, generator=gen) * 0.5 for k in (I, H)),
                    *(torch.randn(c_.gates * H, dtype=dt, generator=gen) * 0.1 for _ in range(2)))
        h_in = torch.randn(B, S, dtype=dt, generator=gen) * 0.5
        with torch.no_grad():
            h, cs = c_.forward(x, *c_.split_state(h_in, w), w, None)
        s = Saved(x, h, cs, *c_.split_state(h_in, w))
        seed = torch.randn(B, S, dtype=dt, generator=gen)
        dense = c_.chain(split_mod._summary_backend(), s, w).clone()
        J = c_.chain(cpu, s, w)
        for c in (None, torch.randn(T, B, S, dtype=dt, generator=gen)):
            for past in (None, torch.rand(T, B, generator=gen) < 0.3):
                Jd = dense if past is None else torch.where(past[:, :, None, None], torch.eye(S, dtype=dt), dense)
                P_ref, q_ref = split_mod.chain_summary(Jd, c if c is not None else torch.zeros(T, B, S, dtype=dt))
                v_ref = split_mod._mv(P_ref, seed) + q_ref
                for values in (split_mod.SUMMARY_BLOCK_VALUES, 1, 40 * c_.block_values(s, w)):
                    old, split_mod.SUMMARY_BLOCK_VALUES = split_mod.SUMMARY_BLOCK_VALUES, values
                    try:
                        P, v = split_mod.slice_map(c_, s, w, cpu, J, Plan(seed, c, past, False))
                    finally:
                        split_mod.SUMMARY_BLOCK_VALUES = old
                    worst = max(worst, ((P - P_ref).abs().max() / P_ref.abs().max()).item(),
                                ((v - v_ref).abs().max() / v_ref.abs().max()).item())
    assert worst <= 1e-10, worst
    assert bool(calls) == kernel  # the kernel ran where it was asked for


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_the_kernels_slice_product_equals_the_dense_chains(dtype, tol):
    """rnn_chain_product (chain_scan.c's chain_product: a middle rank's whole map from the states) against the dense
    chain composed by chain_summary's tree: batches of a vector register's lanes and of fewer (17, 3: the lanes a call
    takes are powers of two), odd and one-step slices, with and without per-step gradients."""
    from bppsa.backends.cpu import native
    from bppsa.backends.cpu.chain import rnn_chain_product
    from bppsa.nn.split import chain_summary

    if not native.available():
        pytest.skip(f"the CPU kernel is unavailable: {native.unavailable_reason()}")
    H, I = 20, 2
    worst = 0.0
    for B in (3, 17):
        for T in (1, 37, 300):
            gen = torch.Generator().manual_seed(T + B)
            h = torch.randn(T, B, H, dtype=dtype, generator=gen).tanh() * 0.9
            x = torch.randn(T, B, I, dtype=dtype, generator=gen)
            W = torch.randn(H, H, dtype=dtype, generator=gen) * (1.2 / H ** 0.5)
            J = W.t() * (1 - h * h).flip(0).unsqueeze(-2)
            for c in (None, torch.randn(T, B, H, dtype=dtype, generator=gen)):
                P, q = rnn_chain_product(h, W, x, c)
                P_ref, q_ref = chain_summary(J, c if c is not None else torch.zeros(T, B, H, dtype=dtype))
                worst = max(worst, ((P - P_ref).abs().max() / P_ref.abs().max()).item())
                assert (q is None) == (c is None)
                if c is not None:
                    worst = max(worst, ((q - q_ref).abs().max() / q_ref.abs().max()).item())
    assert worst <= tol, worst
