"""bppsa workers' analysis, claims rows and figure, on synthetic measurements (the measuring itself runs in the
workflow and is exercised by tests/test_distributed.py's processes)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from bppsa.analysis import claims
from bppsa.analysis import workers as analysis


def _time_df(n=8, bppsa2=0.5, fwd2=0.3, sweeps=0, seed=0):
    """Rounds of every method: BPPSA at p = 1 takes ~1 s to back-propagate after a 0.3 s forward; at p = 2 ~``bppsa2``
    s after a forward of ~``fwd2`` s (its ``sweeps``: 0, the serial hand-off it fell back to), the hand-off's forward
    ~0.3 s (rank 1 a little less everywhere)."""
    rng = np.random.default_rng(seed)
    rows = []

    def row(r, p, method, rank, bwd, fwd=math.nan, threads=1, swept=math.nan):
        return {"round": r, "p": p, "method": method, "rank": rank, "threads": threads, "backward_s": bwd,
                "forward_s": fwd, "fwd_bwd_s": fwd + bwd, "forward_sweeps": swept}

    for r in range(n):
        noise = lambda: 1 + 0.01 * rng.standard_normal()  # noqa: E731
        rows += [row(r, 1, "bppsa", 0, 1.0 * noise(), 0.3 * noise(), swept=0),
                 row(r, 1, "pipeline", 0, 1.2 * noise(), 0.4 * noise()),
                 row(r, 1, "sequential", 0, 0.3 * noise(), 0.3 * noise()),
                 row(r, 1, "threads", 0, 0.55 * noise(), 0.2 * noise(), threads=2),
                 row(r, 2, "bppsa", 0, bppsa2 * noise(), fwd2 * noise(), swept=sweeps),
                 row(r, 2, "bppsa", 1, 0.5 * bppsa2, 0.5 * fwd2, swept=sweeps),
                 row(r, 2, "bppsa-handoff", 0, bppsa2 * noise(), 0.3 * noise(), swept=0),
                 row(r, 2, "bppsa-handoff", 1, 0.5 * bppsa2, 0.15, swept=0),
                 row(r, 2, "pipeline", 0, 1.1 * noise(), 0.4 * noise()),
                 row(r, 2, "pipeline", 1, 0.6, 0.4)]
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
    assert len(steps) == 8 * 7  # (round, p, method) once each
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
    # the whole step and the forward, each the slowest rank's own metric
    step = s.loc["BPPSA training step (forward + backward), p = 1 against p = 2 (speedup)"]
    assert step["metric"] == "fwd_bwd_s" and step["ratio"] == pytest.approx(1.3 / 0.8, rel=0.03)
    assert step["aim"] == 1.7 and step["meets"] == False  # noqa: E712 - its interval lies below the aim
    fwd = s.loc["BPPSA forward, p = 1 against p = 2 (speedup)"]
    assert fwd["metric"] == "forward_s" and fwd["ratio"] == pytest.approx(1.0, rel=0.03) and np.isnan(fwd["aim"])
    hand = s.loc["BPPSA forward, the serial hand-off against the default (the sweeps), both at p = 2 (speedup)"]
    assert hand["ratio"] == pytest.approx(1.0, rel=0.03) and hand["meets"] == False  # noqa: E712
    fast = analysis.summary(_time_df(fwd2=0.16, sweeps=2), None).set_index("compared")
    assert bool(fast.loc["BPPSA forward, the serial hand-off against the default (the sweeps), both at p = 2 "
                         "(speedup)", "meets"])
    assert bool(fast.loc["BPPSA training step (forward + backward), p = 1 against p = 2 (speedup)", "meets"])
    # a time.csv from before the forward was timed: the backward's comparisons alone
    old = analysis.summary(t.drop(columns=["forward_s", "fwd_bwd_s"]), None)
    assert set(old["metric"]) == {"backward_s"} and len(old) == 4  # (no rank_scan rows here)


def test_worker_claims_from_a_results_tree(tmp_path):
    folder = tmp_path / "cpu" / "workers"
    folder.mkdir(parents=True)
    t, m = _time_df(), _mem_df()
    t.to_csv(folder / "time.csv", index=False)
    m.to_csv(folder / "memory.csv", index=False)
    analysis.summary(t, m).to_csv(folder / "summary.csv", index=False)
    rows = claims.worker_claims(tmp_path)
    assert [c.verdict for c in rows] == ["partly", "partly"]  # p <= 2: what it cannot show is said
    assert "p ≤ 2" in rows[0].reason and "p = 1 → 2: 2" in rows[0].measured and "0.45" in rows[1].measured
    assert claims.worker_claims in claims.ROWS


def test_worker_step_claims_judge_the_step_and_the_forward_against_their_aims(tmp_path):
    folder = tmp_path / "cpu" / "workers"
    folder.mkdir(parents=True)

    def rows(t):
        t.to_csv(folder / "time.csv", index=False)
        analysis.summary(t, None).to_csv(folder / "summary.csv", index=False)
        return claims.worker_step_claims(tmp_path)

    step, forward = rows(_time_df())  # the default forward fell back to the serial hand-off: no faster
    assert "training step" in step.claim and "the sweeps against the serial hand-off" in forward.claim
    assert step.verdict == "partly" and "by less than 1.7×" in step.reason
    assert "step p = 1 → 2: 1.62×" in step.measured and "the forward 1" in step.measured
    assert forward.verdict == "not reproduced" and "the interval contains 1" in forward.reason
    for c in (step, forward):
        assert "100% of its rank-steps" in c.measured and "ran the serial hand-off in every timed step" in c.reason
        assert c.paper_value.startswith("≥ 1.7×")
    step, forward = rows(_time_df(fwd2=0.16, sweeps=2))  # sweeps that pay
    assert step.verdict == forward.verdict == "holds" and "0% of its rank-steps" in forward.measured
    assert "hand-off in every" not in forward.reason
    assert claims.worker_step_claims in claims.ROWS
    t = _time_df()
    rows(t[t["p"] == 1])  # no p = 2: said, not guessed
    assert [c.verdict for c in claims.worker_step_claims(tmp_path)] == ["not measurable here"] * 2


def test_aim_verdicts():
    assert claims.aim_verdict(1.8, 2.0, 1.7)[0] == "holds"
    assert claims.aim_verdict(1.5, 1.9, 1.7) == ("partly", "the interval reaches 1.7× but does not clear it")
    assert claims.aim_verdict(1.1, 1.5, 1.7)[0] == "partly"
    assert claims.aim_verdict(0.5, 0.9, 1.7)[0] == "not reproduced"
    assert claims.aim_verdict(0.9, 1.1, 1.7)[0] == "not reproduced"
    assert claims.aim_verdict(math.nan, math.nan, 1.7)[0] == "not measurable here"


def test_worker_verdicts():
    assert claims.workers_step_verdict(1.5, 2.5, 4)[0] == "holds"
    assert claims.workers_step_verdict(1.5, 2.5, 2)[0] == "partly"
    assert claims.workers_step_verdict(0.5, 0.8, 4)[0] == "not reproduced"
    assert claims.workers_step_verdict(math.nan, math.nan, 4)[0] == "not measurable here"
    assert claims.workers_memory_verdict(0.26, 1.0, 4)[0] == "holds"
    assert claims.workers_memory_verdict(0.8, 1.0, 4)[0] == "partly"
    assert claims.workers_memory_verdict(1.1, 1.0, 2)[0] == "not reproduced"
    # a shape whose peak did not grow at p = 1 (the .test workflow's): nothing to compare, and said so
    v, reason = claims.workers_memory_verdict(0.0, 0.0, 2)
    assert v == "not measurable here" and "did not grow" in reason
    assert "clear_refs" in claims.workers_memory_verdict(math.nan, math.nan, 2)[1]  # not measured at all


def test_the_figure_draws_from_the_csvs(tmp_path):
    from bppsa.plots.registry import FIGURES

    folder = tmp_path / "results" / "cpu" / "workers"
    folder.mkdir(parents=True)
    _time_df().to_csv(folder / "time.csv", index=False)
    _mem_df().to_csv(folder / "memory.csv", index=False)
    out = tmp_path / "results" / "fig_workers.png"
    FIGURES["workers"].run(str(tmp_path / "results"), [], [str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_the_figure_has_the_forward_backward_step_and_memory_panels_and_reads_at_a_glance(tmp_path, monkeypatch):
    from test_figures import _assert_reads_at_a_glance

    from bppsa.plots import common, workers

    folder = tmp_path / "results" / "cpu" / "workers"
    folder.mkdir(parents=True)
    _time_df().to_csv(folder / "time.csv", index=False)
    _mem_df().to_csv(folder / "memory.csv", index=False)
    kept = []
    monkeypatch.setattr(common.plt, "close", kept.append)
    workers.draw(tmp_path / "results", [], [tmp_path / "fig.png"])
    (fig,) = kept
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["cpu: forward", "cpu: backward", "cpu: training step (forward + backward)",
                      "cpu: memory per rank"]
    for ax in fig.axes[:3]:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "BPPSA, forward by the serial hand-off" in labels and "pipeline on the same split (GPipe)" in labels
    forward, backward, step = fig.axes[:3]

    def data(ax, label):  # the (p, ms) points of a method's error-bar line
        (line,) = [c.lines[0] for c in ax.containers if c.get_label().startswith(label)]
        return list(line.get_xdata()), list(line.get_ydata())

    assert data(forward, "BPPSA, forward by the serial hand-off")[0] == [2]  # measured at p > 1 only
    # the medians drawn are the slowest rank's forward and step (ms)
    assert data(forward, "BPPSA (split")[1] == pytest.approx([300, 300], rel=0.05)
    assert data(step, "BPPSA (split")[1] == pytest.approx([1300, 800], rel=0.05)
    assert data(backward, "BPPSA (split")[1] == pytest.approx([1000, 500], rel=0.05)
    assert "serial hand-off in 16 of 16 rank-steps" in " ".join(t.get_text() for t in fig.texts)
    _assert_reads_at_a_glance(fig, "fig_workers.png")
    common.plt.close(fig)


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
                assert 0 < timed["forward_s"] <= timed["fwd_bwd_s"] - timed["backward_s"] + 1e-9, timed  # the fill
    assert (2, "last") not in res[0]  # rank 0 is outside p = 2's group


def test_time_rows_record_the_forward_and_the_hand_off_beside_the_default():
    """Two real gloo ranks, tiny sizes: every split step records its forward, backward and whole step, and how its
    forward ran; the hand-off method never sweeps, and runs at p > 1 only."""
    from bppsa.bench import workers

    t = pd.DataFrame(workers.time_rows([1, 2], T=12, B=4, H=6, rounds=2, threads=1, timeout=300))
    assert set(zip(t["p"], t["method"])) >= {(1, "bppsa"), (2, "bppsa"), (2, "bppsa-handoff"), (1, "pipeline"),
                                             (2, "pipeline"), (1, "sequential")}
    assert (1, "bppsa-handoff") not in set(zip(t["p"], t["method"]))
    split = t[t["method"].isin(workers.SPLIT + ("pipeline", "sequential"))]
    assert (split["forward_s"] > 0).all() and (split["forward_s"] <= split["fwd_bwd_s"]).all()
    assert (split["backward_s"] <= split["fwd_bwd_s"]).all()
    assert set(t.loc[t["method"] == "bppsa-handoff", "forward_sweeps"]) == {0}
    assert t.loc[t["method"] == "bppsa", "forward_sweeps"].between(0, 2).all()  # at most p sweeps
    assert t.loc[t["method"].str.startswith("scan-"), "forward_s"].isna().all()


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
