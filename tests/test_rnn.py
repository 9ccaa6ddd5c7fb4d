"""After a BPPSA backward every .grad equals the autograd baseline's, same weights and batch."""
import copy
import warnings

import pytest
import torch

from bppsa.backends import TorchBackend, get_backend
from bppsa.jacobians.recurrent import rnn_jacobians_t
from bppsa.models.rnn import RNNClassifier
from bppsa.precision import TOLERANCE
from bppsa.verify import grad_errors

DT = {"float64": torch.float64, "float32": torch.float32}


def _run(T, B, layout, dtype, L_m=None, hidden=20, seed=0):
    torch.manual_seed(seed)
    ref = RNNClassifier(hidden=hidden).to(DT[dtype])
    got = copy.deepcopy(ref)
    p = torch.rand(1, B, 1) * 0.9 + 0.05
    x = torch.bernoulli(p.expand(T, B, 1)).to(DT[dtype])
    y = torch.randint(0, 10, (B,))
    l_ref = ref.baseline_step(x, y)
    l_got = got.bppsa_step(x, y, TorchBackend(), layout, L_m)
    assert torch.allclose(l_ref, l_got)
    return grad_errors(ref, got)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layout", ["paper", "fused"])
@pytest.mark.parametrize("B", [1, 5, 16])
@pytest.mark.parametrize("T", [1, 2, 3, 17, 1000])
def test_bppsa_grads_equal_autograd(T, B, layout, dtype):
    errs = _run(T, B, layout, dtype)
    assert set(errs) == {"cell.weight_ih_l0", "cell.weight_hh_l0", "cell.bias_ih_l0", "cell.bias_hh_l0",
                         "head.weight", "head.bias"}
    assert max(errs.values()) <= TOLERANCE[dtype], errs


@pytest.mark.parametrize("L_m", [0, 2, 5])
def test_heterogeneous_scan_is_exact_too(L_m):
    assert max(_run(300, 5, "fused", "float64", L_m=L_m).values()) <= 1e-10


def test_grads_accumulate_like_autograd():
    """Two backward passes without zero_grad add up, as .backward() does."""
    torch.manual_seed(1)
    ref = RNNClassifier()
    got = copy.deepcopy(ref)
    x = torch.bernoulli(torch.full((9, 3, 1), 0.5))
    y = torch.randint(0, 10, (3,))
    for _ in range(2):
        ref.baseline_step(x, y)
        got.bppsa_step(x, y, TorchBackend(), "fused")
    assert max(grad_errors(ref, got).values()) <= 1e-4


def test_jacobians_match_autograd_jacobian():
    """The analytic transposed Jacobians equal torch.func.jacrev of one RNN step."""
    torch.manual_seed(2)
    H = 6
    cell = torch.nn.RNN(1, H).double()
    h_prev = torch.randn(H, dtype=torch.float64)
    x = torch.rand(1, dtype=torch.float64)
    W_ih, W_hh, b = cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0 + cell.bias_hh_l0
    step = lambda h: torch.tanh(W_ih @ x + W_hh @ h + b)  # noqa: E731
    h = step(h_prev).detach()
    jac = torch.func.jacrev(step)(h_prev)  # ∂h_t/∂h_{t-1}
    fused = rnn_jacobians_t(h.view(1, 1, H), W_hh.detach(), "fused")[0, 0]
    assert torch.allclose(fused, jac.t(), atol=1e-12)
    paper = rnn_jacobians_t(h.view(1, 1, H), W_hh.detach(), "paper")
    assert torch.allclose(paper[1, 0] @ paper[0, 0], jac.t(), atol=1e-12)


def test_unknown_layout_and_backend_are_rejected():
    with pytest.raises(ValueError, match="unknown layout"):
        rnn_jacobians_t(torch.zeros(2, 1, 3), torch.zeros(3, 3), "diagonal")
    with pytest.raises(ValueError, match="unknown backend 'cuda-magic'"):
        get_backend("cuda-magic")
    with pytest.raises(RuntimeError, match="cupy"):
        if torch.cuda.is_available():
            pytest.skip("CUDA present: the cupy backend may be usable")
        get_backend("cupy")


def test_every_backend_is_a_backend():
    """Each backend provides what the models call (bppsa.backends.Backend); CupyBackend without constructing it."""
    from bppsa.backends import Backend
    from bppsa.backends.cpu import CpuBackend
    from bppsa.backends.cuda import CupyBackend

    for be in (TorchBackend(), CpuBackend(), CpuBackend(sequential=True), get_backend("torch")):
        assert isinstance(be, Backend), be
    for name in ("scan", "rnn_jacobians_t", "gru_jacobians_t", "cell_grads"):
        assert callable(getattr(CupyBackend, name))
    assert CupyBackend.name == "cupy"


def test_auto_backend_is_the_cpu_fast_path_on_cpu(monkeypatch):
    """'auto' on a CPU is the compiled fast path; where its kernel cannot be built, the torch twin, with a
    warning that gives the reason."""
    from bppsa.backends.cpu import native

    if native.available():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert get_backend("auto", torch.device("cpu")).name == "cpu"
            assert get_backend("auto").name == "cpu"
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C compiler ('cc' not on PATH)")
    with pytest.warns(RuntimeWarning, match=r"uses torch: .*no C compiler \('cc' not on PATH\).*bppsa doctor"):
        assert get_backend("auto", torch.device("cpu")).name == "torch"
    assert get_backend("cpu", torch.device("cpu")).name == "cpu"  # asked for by name: its numpy fallback
