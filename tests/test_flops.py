"""Static FLOP analysis: the formula on hand-checked cases, the schedule against the torch scan, and
the scan's gradients against autograd's backward on a tiny pruned VGG-style network."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

from bppsa import flops as fl
from bppsa import scan
from bppsa.models.vgg import VGG11, apply_masks, magnitude_masks


def test_product_flop_by_hand():
    A = sp.csr_matrix(np.array([[1.0, 1.0], [0.0, 1.0]]))
    B = sp.csr_matrix(np.array([[1.0, 0.0], [1.0, 1.0]]))
    # multiply pairs: C00 two, C01 one, C10 one, C11 one -> 5 multiply-adds -> 10 FLOP
    assert fl.product_flop(A, B) == 10
    assert fl.product_flop(A, np.array([0.0, 3.0])) == 2 * 2  # column 1 of A has 2 non-zeros, v[0] is zero
    # a diagonal with explicit zeros counts them; dropped, they cost nothing
    D = sp.csr_matrix((np.array([1.0, 0.0]), np.array([0, 1]), np.array([0, 1, 2])), shape=(2, 2))
    assert fl.product_flop(D, B) == 2 * (1 * 1 + 1 * 2)
    D.eliminate_zeros()
    assert fl.product_flop(D, B) == 2 * 1
    with pytest.raises(ValueError):
        fl.product_flop(A, sp.csr_matrix(np.ones((3, 1))))


def test_spgemm_dense_path_equals_scipy():
    rng = np.random.default_rng(0)
    A = sp.random(40, 30, density=0.2, format="csr", random_state=rng)
    B = sp.random(30, 50, density=0.2, format="csr", random_state=rng)
    C1 = fl.spgemm(A, B, dense_min_flop=0)
    C2 = fl.spgemm(A, B, dense_min_flop=np.inf)
    assert C1.nnz == C2.nnz and abs(C1 - C2).max() < 1e-12 and abs(C1 - (A @ B)).max() < 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 21, 22])
@pytest.mark.parametrize("L_m", [None, 0, 1, 2, 3])
def test_schedule_matches_torch_scan(n, L_m):
    rng = np.random.default_rng(n)
    H = 6
    J = [sp.random(H, H, density=0.5, format="csr", random_state=rng) for _ in range(n)]
    g = rng.standard_normal(H)
    out, ops = fl.scan_with_flops(g, J, L_m)
    dense = torch.from_numpy(np.stack([m.toarray() for m in J]))[:, None]
    ref = scan.blelloch_scan(torch.from_numpy(g)[None], dense, L_m)
    for p in range(n):
        np.testing.assert_allclose(out[p], ref[p, 0].numpy(), rtol=1e-10, atol=1e-12)
    # the same products the torch scan performs, level by level
    lv = scan.levels(n + 1)
    L = len(lv) if L_m is None else min(L_m, len(lv))
    for level in lv[:L]:
        up = [o for o in ops if o.phase == "up" and o.d == level.d]
        assert [(o.l, o.r) for o in up] == level.pairs()
        assert [o.kind for o in up] == ["mv"] + ["mm"] * (len(up) - 1)
        down = [o for o in ops if o.phase == "down" and o.d == level.d]
        assert [(o.l, o.r) for o in down] == level.pairs()[1:]
        assert all(o.kind == "mv" for o in down)
        assert sum(o.critical for o in up) == 1 and sum(o.critical for o in down) == (1 if down else 0)
    assert all(o.flop == fl.product_flop(J[0], g) for o in ops if (o.l, o.r) == (0, 1))


def test_level_names_match_fig3():
    # VGG-11's conv part: 21 Jacobians + the gradient -> 5 levels; Fig 3: L0-L4 up, L5-L10 down
    D = scan.num_levels(22)
    assert D == 5
    assert [fl.level_label("up", d, D) for d in range(D - 1)] == ["L1", "L2", "L3", "L4"]
    assert [fl.level_label("down", d, D) for d in reversed(range(D))] == ["L6", "L7", "L8", "L9", "L10"]


def _tiny_net(seed: int) -> VGG11:
    torch.manual_seed(seed)
    m = VGG11(width=1 / 32, image_size=32).double()
    apply_masks(m, magnitude_masks(m, 0.5))
    return m


@pytest.mark.parametrize("L_m", [None, 0, 2, 3])
@pytest.mark.parametrize("drop_zeros", [True, False])
def test_scan_gradients_equal_autograd_backward(L_m, drop_zeros):
    """The FLOP scan runs the real products: its gradients are autograd's, so the schedule is right."""
    m = _tiny_net(1)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    acts = [x]
    for layer in m.features:
        acts.append(layer(acts[-1]))
        acts[-1].retain_grad()
    nn.functional.cross_entropy(m.classifier(acts[-1].flatten(1)), torch.tensor([3, 7])).backward()
    for s in range(2):
        res = fl.analyse_sample(m.features, x[s], acts[-1].grad[s], L_m, drop_zeros=drop_zeros)
        assert len(res["scan"]) == len(m.features)
        for i, v in enumerate(res["scan"]):  # position i+1 holds the gradient at layer n-i's output
            np.testing.assert_allclose(v, acts[-1 - i].grad[s].numpy().ravel(), rtol=1e-10, atol=1e-14)
        for i, v in enumerate(res["baseline"]):
            np.testing.assert_allclose(v, acts[-1 - i].grad[s].numpy().ravel(), rtol=1e-10, atol=1e-14)
        base = [o for o in res["ops"] if o.phase == "baseline"]
        assert len(base) == len(m.features) - 1 and all(o.kind == "mv" and o.n == 1 for o in base)


def test_pruning_lowers_flop():
    torch.manual_seed(0)
    dense = VGG11(width=1 / 16).double()
    pruned = VGG11(width=1 / 16).double()
    pruned.load_state_dict(dense.state_dict())
    apply_masks(pruned, magnitude_masks(pruned, 0.9))
    x = torch.randn(3, 32, 32, dtype=torch.float64)
    g = torch.randn(dense.features(x[None]).shape[1:], dtype=torch.float64)
    fd = sum(o.flop for o in fl.analyse_sample(dense.features, x, g, 2)["ops"])
    fp = sum(o.flop for o in fl.analyse_sample(pruned.features, x, g, 2)["ops"])
    assert 0 < fp < fd


def test_unsupported_layer_is_named():
    feats = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.GELU())
    with pytest.raises(ValueError, match="GELU"):
        fl.layer_chain(feats, torch.randn(1, 4, 4))
