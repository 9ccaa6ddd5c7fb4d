"""bppsa workers' analysis, claims rows and figure, on synthetic measurements (the measuring itself runs in the
workflow and is exercised by tests/test_distributed.py's processes)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from bppsa.analysis import claims
from bppsa.analysis import workers as analysis


def _time_df(n=8, bppsa2=0.5, seed=0):
    """Rounds of every method: BPPSA at p = 1 takes ~1 s and at p = 2 ~``bppsa2`` s (rank 1 a little less)."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n):
        noise = lambda: 1 + 0.01 * rng.standard_normal()  # noqa: E731
        rows += [{"round": r, "p": 1, "method": "bppsa", "rank": 0, "threads": 1, "backward_s": 1.0 * noise()},
                 {"round": r, "p": 1, "method": "pipeline", "rank": 0, "threads": 1, "backward_s": 1.2 * noise()},
                 {"round": r, "p": 1, "method": "sequential", "rank": 0, "threads": 1, "backward_s": 0.3 * noise()},
                 {"round": r, "p": 1, "method": "threads", "rank": 0, "threads": 2, "backward_s": 0.55 * noise()},
                 {"round": r, "p": 2, "method": "bppsa", "rank": 0, "threads": 1, "backward_s": bppsa2 * noise()},
                 {"round": r, "p": 2, "method": "bppsa", "rank": 1, "threads": 1, "backward_s": 0.5 * bppsa2},
                 {"round": r, "p": 2, "method": "pipeline", "rank": 0, "threads": 1, "backward_s": 1.1 * noise()},
                 {"round": r, "p": 2, "method": "pipeline", "rank": 1, "threads": 1, "backward_s": 0.6}]
    df = pd.DataFrame(rows)
    return df.assign(seq_len=1000, batch=16, hidden=20, dtype="float32", loss="last", micro_batches=4, profile="test")


def _mem_df(b1=100e6, b2=45e6):
    return pd.DataFrame([{"p": 1, "method": "bppsa", "rank": 0, "threads": 1, "peak_bytes": b1, "backward_s": 1},
                         {"p": 2, "method": "bppsa", "rank": 0, "threads": 1, "peak_bytes": b2, "backward_s": 1},
                         {"p": 2, "method": "bppsa", "rank": 1, "threads": 1, "peak_bytes": b2 * 0.9,
                          "backward_s": 1},
                         {"p": 1, "method": "pipeline", "rank": 0, "threads": 1, "peak_bytes": 80e6, "backward_s": 1},
                         {"p": 2, "method": "pipeline", "rank": 0, "threads": 1, "peak_bytes": 42e6,
                          "backward_s": 1}])


def test_a_step_is_its_slowest_rank_and_the_summary_pairs_rounds():
    t = _time_df()
    steps = analysis.step_times(t)
    assert len(steps) == 8 * 6  # (round, p, method) once each
    s = analysis.summary(t, _mem_df()).set_index("compared")
    speed = s.loc["BPPSA backward, p = 1 against p = 2 (speedup)"]
    assert speed["ratio"] == pytest.approx(2.0, rel=0.05) and speed["ci_lo"] <= speed["ratio"] <= speed["ci_hi"]
    assert speed["meets"] is True or speed["meets"] == True  # noqa: E712 - pandas may box the bool
    pipe = s.loc["pipeline backward against BPPSA's, both at p = 2 (speedup)"]
    assert pipe["ratio"] == pytest.approx(2.2, rel=0.05)
    threads = s.loc["BPPSA at p = 2 against one process on the CPU kernel with 2 threads (time ratio)"]
    assert threads["ratio"] == pytest.approx(0.5 / 0.55, rel=0.05) and bool(threads["meets"])
    memory = s.loc["peak memory per rank, BPPSA p = 2 against p = 1 (ratio)"]
    assert memory["ratio"] == pytest.approx(0.45) and bool(memory["meets"])
    slow = analysis.summary(_time_df(bppsa2=1.5), None).set_index("compared")
    assert slow.loc["BPPSA backward, p = 1 against p = 2 (speedup)", "meets"] == False  # noqa: E712


def test_worker_claims_from_a_results_tree(tmp_path):
    folder = tmp_path / "cpu" / "workers"
    folder.mkdir(parents=True)
    t, m = _time_df(), _mem_df()
    t.to_csv(folder / "time.csv", index=False)
    m.to_csv(folder / "memory.csv", index=False)
    analysis.summary(t, m).to_csv(folder / "summary.csv", index=False)
    rows = claims.worker_claims(tmp_path)
    assert [c.verdict for c in rows] == ["partly", "partly"]  # p <= 2: what it cannot show is said
    assert "p ≤ 2" in rows[0].reason and "p = 1 → 2: 2.0" in rows[0].measured and "0.45" in rows[1].measured
    assert claims.worker_claims in claims.ROWS


def test_worker_verdicts():
    assert claims.workers_step_verdict(1.5, 2.5, 4)[0] == "holds"
    assert claims.workers_step_verdict(1.5, 2.5, 2)[0] == "partly"
    assert claims.workers_step_verdict(0.5, 0.8, 4)[0] == "not reproduced"
    assert claims.workers_step_verdict(math.nan, math.nan, 4)[0] == "not measurable here"
    assert claims.workers_memory_verdict(0.26, 4)[0] == "holds"
    assert claims.workers_memory_verdict(0.8, 4)[0] == "partly"
    assert claims.workers_memory_verdict(1.1, 2)[0] == "not reproduced"


def test_the_figure_draws_from_the_csvs(tmp_path):
    from bppsa.plots.registry import FIGURES

    folder = tmp_path / "results" / "cpu" / "workers"
    folder.mkdir(parents=True)
    _time_df().to_csv(folder / "time.csv", index=False)
    _mem_df().to_csv(folder / "memory.csv", index=False)
    out = tmp_path / "results" / "fig_workers.png"
    FIGURES["workers"].run(str(tmp_path / "results"), [], [str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"


# -- the pipeline baseline: torch.distributed.pipelining's GPipe schedule over the split (bppsa.bench.gpipe) ------

# p -> the global ranks of its group in a spawn of 3 (p = 2 on ranks 1, 2: group ranks differ from global ones)
GPIPE_GROUPS = {2: [1, 2], 3: None}
GPIPE_T, GPIPE_B, GPIPE_H, GPIPE_I, GPIPE_M = 11, 6, 4, 3, 3  # T divisible by neither p; 3 micro-batches of 2


def gpipe_worker(rank: int, world: int) -> dict:
    """On each rank: for each group it belongs to and each loss, the GPipe step's all-reduced weight gradients
    against autograd of the single-process torch.nn.RNN on the whole sequence (relative errors), and its times."""
    import torch
    from test_distributed import member_groups

    from bppsa.bench import workers
    from bppsa.bench.gpipe import GPipe

    out = {}
    for p, group, r in member_groups(GPIPE_GROUPS, rank):
        for loss in ("last", "steps"):
            torch.manual_seed(1)
            ref = torch.nn.RNN(GPIPE_I, GPIPE_H, dtype=torch.float64)
            x, g = workers._setup(GPIPE_T, GPIPE_B, GPIPE_H, GPIPE_I, torch.float64, 2, loss)
            pipe = GPipe(ref, group, r, p, GPIPE_B, GPIPE_M, loss)
            timed: dict = {}
            for _ in range(2):  # a second step on the same schedule: the gradients are the step's, not summed
                pipe.step(workers._slice(x, p, r), workers._slice(g, p, r), timed)
            o, _ = ref(x)
            torch.autograd.backward(o, g)
            err = {name: ((q.grad - dict(ref.named_parameters())[name].grad).norm()
                          / dict(ref.named_parameters())[name].grad.norm()).item()
                   for name, q in pipe.rnn.named_parameters()}
            out[(p, loss)] = (err, timed)
    return out


def test_the_gpipe_pipeline_gives_autograds_gradients():
    from bppsa.distributed.launch import run_local

    res = run_local(gpipe_worker, 3, (), timeout=300)
    for p, ranks in GPIPE_GROUPS.items():
        members = [res[k] for k in (ranks or range(3))]
        for loss in ("last", "steps"):
            for got in members:
                err, timed = got[(p, loss)]
                assert set(err) == {"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"}
                assert max(err.values()) <= 1e-10, (p, loss, err)
                assert 0 < timed["backward_s"] <= timed["fwd_bwd_s"], timed
    assert (2, "last") not in res[0]  # rank 0 is outside p = 2's group


def test_the_pipelines_micro_batches_must_divide_the_batch():
    from bppsa.bench import workers

    with pytest.raises(ValueError, match="--micro-batches 3 must divide --batch 16"):
        workers.time_rows([1, 2], T=8, B=16, H=2, micro_batches=3)


def test_bppsa_workers_checks_its_micro_batches_before_any_work(tmp_path, capsys):
    from bppsa.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["workers", "--micro-batches", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "argument --micro-batches: must be a positive integer, got '0'" in capsys.readouterr().err
    assert main(["workers", "--batch", "16", "--micro-batches", "3", "--out", str(tmp_path / "w")]) != 0
    assert "--micro-batches 3 must divide --batch 16" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_bppsa_workers_writes_its_timing_before_the_memory_spawns(tmp_path, monkeypatch):
    """A run stopped during the memory spawns (gpu_check's time limit) keeps the whole timing: time.csv and its
    summary are written before the first memory spawn, and rewritten with the memory once it is measured."""
    from bppsa.bench import workers as bench
    from bppsa.cli import main

    t = _time_df(n=6)
    monkeypatch.setattr(bench, "time_rows", lambda *a, **k: t.drop(columns=["seq_len", "batch", "hidden", "dtype",
                                                                            "loss", "micro_batches", "profile"])
                        .to_dict("records"))

    def stopped(*a, **k):
        assert pd.read_csv(tmp_path / "w" / "time.csv").shape[0] == len(t)
        raise KeyboardInterrupt  # what a time limit's signal does mid-spawn

    monkeypatch.setattr(bench, "memory_rows", stopped)
    with pytest.raises(KeyboardInterrupt):
        main(["workers", "--seq-len", "1000", "--out", str(tmp_path / "w")])
    summary = pd.read_csv(tmp_path / "w" / "summary.csv")
    assert not summary.empty and pd.read_csv(tmp_path / "w" / "memory.csv").empty

    monkeypatch.setattr(bench, "memory_rows", lambda *a, **k: _mem_df().to_dict("records"))
    assert main(["workers", "--seq-len", "1000", "--out", str(tmp_path / "w")]) == 0
    assert len(pd.read_csv(tmp_path / "w" / "memory.csv")) == len(_mem_df())
