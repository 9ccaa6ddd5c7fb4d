"""Latent Bounded Interfaces (bppsa.models.lbi, lbi_scan): the scan backward against autograd of the same model."""
from __future__ import annotations

import copy

import pytest
import torch

from bppsa.backends import get_backend
from bppsa.distributed.launch import run_local
from bppsa.models.lbi import LBILM, DenseLM, lm_loss, prefix_cross_entropy
from bppsa.models.lbi_dist import MODES, Traffic, expected_bytes, rank_worker, step
from bppsa.models.lbi_scan import interface_jacobians_t, scan_backward

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _pair(K, r, B=3, T=7, dtype=torch.float64, seed=0, vocab=13, d=12, heads=3):
    torch.manual_seed(seed)
    ref = LBILM(vocab, d, heads, K, r, max_len=T + 2).to(dtype)
    with torch.no_grad():  # a non-trivial interface: alpha away from its initial value, LayerNorm not the identity
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    got = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)
    return ref, got, x, y


def _max_rel_error(ref, got) -> float:
    errs = {}
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert q.grad is not None, f"the scan backward left no gradient for {name}"
        scale = p.grad.abs().max().item()
        assert scale > 0, f"autograd's gradient of {name} is zero: the comparison would be vacuous"
        errs[name] = (q.grad - p.grad).abs().max().item() / scale
    return max(errs.values())


def _backends():
    out = ["torch", "cpu"]
    if torch.cuda.is_available():
        out += ["cupy", "cupy-factored"]
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("K,r,B,T", [(1, 4, 2, 5), (2, 4, 3, 7), (3, 5, 1, 6), (5, 3, 2, 9), (7, 6, 3, 5)])
def test_scan_backward_matches_autograd(K, r, B, T, dtype):
    ref, got, x, y = _pair(K, r, B, T, dtype, seed=10 * K + r)
    loss = lm_loss(ref(x), y)
    loss.backward()
    out = scan_backward(got, x, y, get_backend("torch"), chunk=2)
    assert abs(float(out.loss) - float(loss.detach())) <= TOL[dtype]
    assert _max_rel_error(ref, got) <= TOL[dtype]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("L_m", [0, 1, None])
def test_every_backend_and_tree_depth_is_exact(backend, L_m):
    device = "cuda" if backend.startswith("cupy") else "cpu"
    ref, got, x, y = _pair(6, 5, 2, 6, seed=4)
    ref, got, x, y = ref.to(device), got.to(device), x.to(device), y.to(device)
    lm_loss(ref(x), y).backward()
    scan_backward(got, x, y, get_backend(backend, torch.device(device)), L_m=L_m)
    assert _max_rel_error(ref, got) <= TOL[torch.float64]


def test_adjoints_are_the_gradients_at_each_interface():
    ref, got, x, y = _pair(5, 4, seed=7)
    E, ms, out = ref.interfaces(x)
    for m in ms:
        m.retain_grad()
    lm_loss(ref.head(out), y).backward()
    adj = scan_backward(got, x, y).adjoints
    assert len(adj) == len(ms) == 5
    for m, a in zip(ms, adj):
        assert torch.allclose(a, m.grad, rtol=0, atol=1e-12 * m.grad.abs().max().item())
        assert m.grad.abs().max() > 0


@pytest.mark.parametrize("chunk", [1, 3, 4, None])
def test_interface_jacobian_is_the_region_maps_jacobian(chunk):
    ref, _, x, _ = _pair(3, 4, B=2, seed=2)
    E, ms, _ = ref.interfaces(x)
    A = interface_jacobians_t(ref.regions[1], E, ms[1], chunk)
    for b in range(2):
        Eb = E[b:b + 1].detach()
        J = torch.autograd.functional.jacobian(lambda m, Eb=Eb: ref.regions[1].interface(Eb, m[None])[0],
                                               ms[1][b].detach())
        assert torch.allclose(A[b], J.T, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="chunk"):
        interface_jacobians_t(ref.regions[1], E, ms[1], 0)
    with pytest.raises(ValueError, match="last region"):
        interface_jacobians_t(ref.regions[2], E, ms[2])


def test_the_dense_baseline_has_the_same_blocks_and_the_lbi_model_reads_the_future():
    torch.manual_seed(0)
    lbi, dense = LBILM(13, 12, 3, 4, 4, 8), DenseLM(13, 12, 3, 4, 8)
    blocks = sum(p.numel() for r in lbi.regions for p in r.blocks.parameters())
    assert blocks == sum(p.numel() for p in dense.blocks.parameters())
    x = torch.randint(0, 13, (2, 8))
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % 13  # change the last token only
    with torch.no_grad():
        assert torch.equal(dense(x)[:, :-1], dense(x2)[:, :-1])  # causal
        assert not torch.allclose(lbi(x)[:, :-1], lbi(x2)[:, :-1])  # the pooled interface sees the last token
        y = torch.randint(0, 13, (2, 8))
        assert prefix_cross_entropy(dense, x, y) == pytest.approx(float(lm_loss(dense(x), y)), rel=1e-6)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="r must"):
        LBILM(13, 12, 3, 2, 0, 8)
    with pytest.raises(ValueError, match="heads"):
        LBILM(13, 12, 5, 2, 4, 8)
    with pytest.raises(ValueError, match="max_len"):
        LBILM(13, 12, 3, 2, 4, 4)(torch.zeros(1, 6, dtype=torch.long))


# -- across ranks (bppsa.models.lbi_dist): real processes in a gloo group ------------------------------------------


def _rank_case(K, r=4, B=3, T=6, seed=0):
    ref, _, x, y = _pair(K, r, B, T, seed=seed)
    sizes = dict(vocab=13, d=12, heads=3, regions=K, r=r, max_len=T + 2)
    loss = lm_loss(ref(x), y)
    loss.backward()
    return ref, sizes, x, y, loss.detach()


def _check_ranks(K, strategy=None):
    ref, sizes, x, y, loss = _rank_case(K, seed=K)
    outs = run_local(rank_worker, K, (sizes, ref.state_dict(), x, y, MODES, "torch", 1, 0, strategy), timeout=300)
    emb = sum(p.numel() for p in ref.embed.parameters()) * 8
    for mode in MODES:
        per_rank = [o[mode] for o in outs]
        assert abs(float(per_rank[-1]["loss"]) - float(loss)) <= 1e-12
        for name, p in ref.named_parameters():  # every parameter has an owner, and every owner has it exactly
            owners = [o["grads"][name] for o in per_rank if name in o["grads"]]
            assert owners, f"{mode}: no rank holds the gradient of {name}"
            for g in owners:
                assert (g - p.grad).abs().max().item() <= 1e-10 * p.grad.abs().max().item(), (mode, name)
        want = expected_bytes(K, 3, 4, 8, mode, strategy)
        for k, o in enumerate(per_rank):  # the payload counted is the formula's, and the embedding's all_reduce
            got = {ph: sum(v for (p_, w, _), v in o["bytes"].items() if p_ == ph and w == "interface")
                   for ph in ("forward", "backward")}
            assert got == {"forward": want["forward"][k], "backward": want["backward"][k]}, (mode, k)
            assert o["bytes"][("backward", "embedding", "all_reduce")] == emb
    pipe = [o["pipeline"] for o in outs]
    assert pipe[0]["calls"].get(("backward", "interface", "send"), 0) == 0  # rank 0 of the pipeline sends nothing
    if strategy != "rounds":  # rank_scan's one all_gather
        assert all(o["scan"]["calls"][("backward", "interface", "all_gather")] == 1 for o in outs)


def test_ranks_match_autograd_over_three_ranks():
    _check_ranks(3)


@pytest.mark.slow
@pytest.mark.parametrize("K", [2, 4])
def test_ranks_match_autograd(K):
    _check_ranks(K, "rounds")


def test_one_rank_in_process_and_a_group_of_the_wrong_size(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ref, got, x, y = _pair(1, 4, seed=5)
        lm_loss(ref(x), y).backward()
        traffic = Traffic()
        step(got, x, y, traffic=traffic)
        assert _max_rel_error(ref, got) <= 1e-10
        assert traffic.total("backward", "interface") == 0  # rank_scan over one rank exchanges nothing
        got.zero_grad(set_to_none=True)
        step(got, x, y, mode="scan-allreduce", traffic=traffic)
        assert _max_rel_error(ref, got) <= 1e-10
        assert traffic.total("backward", "interface") == 3 * 4 * 8  # the broadcast of ā_0 to itself
        with pytest.raises(ValueError, match="2 regions but the process group has 1 ranks"):
            step(_pair(2, 4)[1], x, y)
        with pytest.raises(ValueError, match="mode must be"):
            step(got, x, y, mode="tree")
    finally:
        dist.destroy_process_group()


# -- the claims rows and the figure, from CSVs shaped like the commands' ---------------------------------------------


def _train_csv(folder, model, seed, val, prefix):
    import pandas as pd

    kind, r = ("dense", None) if model == "dense" else ("lbi", int(model[1:]))
    base = dict(kind=kind, r=r, label=model, regions=3, d=32, heads=2, seq=32, batch=8, steps=10, lr=1e-3, seed=seed,
                backward="autograd", device="cpu", params=1, block_params=1, corpus_corpus="pydoc_data.topics",
                corpus_python="3.x", corpus_bytes=1000, corpus_sha256="ab" * 32, profile="test")
    rows = [{**base, "row": "curve", "step": s, "train_ce": val + 1, "val_ce": val + 1 / s} for s in (5, 10)]
    rows.append({**base, "row": "final", "step": 10, "val_ce": val, "val_prefix_ce": prefix})
    (folder / "lbi").mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / "lbi" / f"train_{model}_s{seed}.csv", index=False)


def test_the_claims_rows_and_the_figure_come_from_the_measured_files(tmp_path):
    import pandas as pd

    from bppsa.analysis import claims
    from bppsa.analysis.lbi import gaps, load_train, train_files
    from bppsa.bench.lbi import PAPER
    from bppsa.plots.registry import FIGURES

    dev = tmp_path / "cpu"
    for seed in (0, 1):
        _train_csv(dev, "dense", seed, 2.0 + seed, 2.0 + seed)
        _train_csv(dev, "r16", seed, 2.2 + seed + 0.1 * seed, 2.5 + seed)
        _train_csv(dev, "r4", seed, 2.6 + seed, 2.7 + seed)
    gp = gaps(load_train(train_files(dev))).set_index(["r", "eval"])
    assert gp.loc[(16, "window"), "gap"] == pytest.approx(0.25) and gp.loc[(16, "window"), "seeds"] == 2
    assert gp.loc[(16, "prefix"), "gap"] == pytest.approx(0.5) and gp.loc[(4, "window"), "gap"] == pytest.approx(0.6)

    traffic = []
    for mode in MODES:  # the rows bppsa lbi-ranks writes, from the formula (one count off in the second table)
        want = expected_bytes(2, 8, 16, 4, mode)
        for k in range(2):
            for phase in ("forward", "backward"):
                traffic.append(dict(source="measured", mode=mode, ranks=2, rank=k, regions=2, batch=8, r=16,
                                    itemsize=4, phase=phase, what="interface", bytes=want[phase][k], ops="x",
                                    formula_bytes=want[phase][k]))
            traffic.append(dict(source="measured", mode=mode, ranks=2, rank=k, regions=2, batch=8, r=16, itemsize=4,
                                phase="backward", what="embedding", bytes=999, ops="all_reduce", formula_bytes=None))
        paper = expected_bytes(PAPER["regions"], PAPER["batch"], PAPER["r"], PAPER["itemsize"], mode)
        for k in range(PAPER["regions"]):
            traffic.append(dict(source="paper-config", mode=mode, ranks=8, rank=k, regions=8, batch=1, r=64,
                                itemsize=2, phase="backward", what="interface", bytes=paper["backward"][k],
                                ops="formula", formula_bytes=paper["backward"][k]))
    pd.DataFrame(traffic).to_csv(dev / "lbi" / "traffic.csv", index=False)
    rows = claims.lbi_claims(tmp_path)
    assert [c.verdict for c in rows] == ["holds", "holds"]
    assert "+0.250 ± 0.071" in rows[0].measured and "+0.500" in rows[0].measured
    assert "57344 B = 56.0 KiB" in rows[1].measured and "128 B broadcast" in rows[1].measured
    assert "999 B" in rows[1].measured

    bad = pd.DataFrame(traffic)
    bad.loc[0, "bytes"] += 4
    bad.to_csv(dev / "lbi" / "traffic.csv", index=False)
    assert claims.lbi_claims(tmp_path)[1].verdict == "not reproduced"
    _train_csv(dev, "r16", 0, 2.5, 2.5)
    _train_csv(dev, "r16", 1, 3.5, 3.5)
    assert claims.lbi_claims(tmp_path)[0].verdict == "not reproduced"  # a gap of 0.5 > 0.35
    assert claims.lbi_gap_verdict(0.1, 0.2, 4)[0] == "not measurable here"

    pd.DataFrame(traffic).to_csv(dev / "lbi" / "traffic.csv", index=False)
    pd.DataFrame([dict(mode=m, ranks=2, rank=k, r=16, batch=8, seq=32, d=32, iteration=i, forward_s=0.01,
                       backward_s=0.02 * (1 + i), profile="test", threads=1)
                  for m in MODES for k in range(2) for i in range(3)]).to_csv(dev / "lbi" / "backward_time.csv",
                                                                             index=False)
    out = tmp_path / "fig_lbi.png"
    inputs = [str(p) for p in sorted((dev / "lbi").glob("*.csv"))]
    from test_figures import _assert_reads_at_a_glance

    from bppsa.plots import lbi as lbi_plot

    FIGURES["lbi"].run(str(tmp_path), inputs, [str(out)])
    assert out.stat().st_size > 10_000
    drawn = []
    save = lbi_plot.save
    lbi_plot.save = lambda fig, path: drawn.append(fig)  # keep the figure open, as tests/test_figures.py does
    try:
        FIGURES["lbi"].run(str(tmp_path), inputs, [str(out)])
    finally:
        lbi_plot.save = save
    assert len(drawn[0].axes) == 4
    _assert_reads_at_a_glance(drawn[0], "fig_lbi.png")
    with pytest.raises(ValueError, match="lbi/traffic.csv"):
        FIGURES["lbi"].run(str(tmp_path), inputs[:1], [str(out)])


# -- the corpus and the training run --------------------------------------------------------------------------------


def test_the_corpus_is_cpythons_pydoc_topics_and_splits_cleanly():
    from bppsa.data import text

    data, info = text.corpus()
    assert info["corpus"] == "pydoc_data.topics" and info["bytes"] == len(data) > 100_000 and len(info["sha256"]) == 64
    train, val = text.split(data, 0.1)
    assert len(train) + len(val) == len(data) and torch.equal(torch.cat([train, val]), data)
    vx, vy = text.val_windows(val, 16, 5)
    assert vx.shape == (5, 16) and torch.equal(vx[:, 1:], vy[:, :-1])
    assert torch.equal(text.val_windows(val, 16, 5)[0], vx)  # the same windows every run
    with pytest.raises(ValueError, match="val_fraction"):
        text.split(data, 0)
    with pytest.raises(ValueError, match="shorter than a window"):
        text.val_windows(val[:10], 16, 2)


def test_training_with_the_scan_backward_follows_autograds_run():
    from bppsa.bench.lbi import train_run

    kw = dict(regions=3, d=8, heads=2, seq=8, batch=2, steps=4, lr=1e-2, seed=3, eval_every=2, val_count=4)
    a, fa = train_run("lbi", 3, backward="autograd", **kw)
    s, fs = train_run("lbi", 3, backward="scan", **kw)
    assert [r["step"] for r in a] == [2, 4]
    for ra, rs in zip(a, s):
        assert ra["train_ce"] == pytest.approx(rs["train_ce"], rel=1e-4)
        assert ra["val_ce"] == pytest.approx(rs["val_ce"], rel=1e-4)
    assert fa["val_ce"] == pytest.approx(fs["val_ce"], rel=1e-4) and fa["val_ce"] != pytest.approx(a[0]["val_ce"])
    with pytest.raises(ValueError, match="needs kind 'lbi'"):
        train_run("dense", None, backward="scan", **kw)
