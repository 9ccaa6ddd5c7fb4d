"""BPPSA across processes: the ranks' scan (bppsa.distributed.rank_scan) in real gloo process groups on 127.0.0.1.

One spawn of p ranks runs every case for that p (a spawn costs a torch import per rank; a case costs
milliseconds), and hands back what each rank measured; the assertions run here.
"""
from __future__ import annotations

import pytest
import torch

from bppsa.distributed import RankFailure, compose, default_strategy, local_carries, rank_scan
from bppsa.distributed.launch import LaunchError, _first_node, launcher_env, run_local

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


def scan_suite(rank: int, p: int, group) -> list[tuple]:
    """Every SCAN_CASES case on this rank: (case, relative error against the sequential reference)."""
    out = []
    for i, (dense, reverse, strategy, initial, batch) in enumerate(SCAN_CASES):
        M, c, x0 = _summaries(p, dense, batch, seed=100 + i)
        ref = local_carries(M, c, x0 if initial else None, reverse=reverse)
        got = rank_scan(M[rank], c[rank], group, reverse=reverse, strategy=strategy,
                        initial=x0 if initial else None, timeout=60)
        out.append(((dense, reverse, strategy, initial, batch), _rel(got, ref[rank]), tuple(got.shape)))
    return out


SUITES = {"scan": scan_suite}

# The groups of 4 spawned ranks the suites run in: p -> global ranks (None: the default group of all 4).  Groups
# that skip ranks make the group's ranks differ from the global ones, which the exchanges must translate.
GROUPS = {1: [2], 2: [1, 3], 3: [1, 2, 3], 4: None}


def worker(rank: int, world: int, suites: tuple[str, ...]) -> dict:
    """On each of the 4 ranks: every suite in every group of GROUPS this rank belongs to, {p: {suite: result}}."""
    import torch.distributed as dist

    out = {}
    for p, ranks in GROUPS.items():
        group = dist.new_group(ranks) if ranks is not None else None  # every rank creates every group
        if ranks is not None and rank not in ranks:
            continue
        r = dist.get_rank(group)
        out[p] = {name: SUITES[name](r, p, group) for name in suites}
    return out


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
    assert tr == {"rank": 1, "world_size": 2, "local_rank": 1, "master_addr": "h", "master_port": 7}
    sl = launcher_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "12",
                       "SLURM_JOB_NODELIST": "node[07-09],gpu1"})
    assert sl["rank"] == 3 and sl["world_size"] == 4 and sl["master_addr"] == "node07"
    assert sl["master_port"] == 20012
    assert _first_node("a,b") == "a" and _first_node("gpu7,node[01-04]") == "gpu7"
