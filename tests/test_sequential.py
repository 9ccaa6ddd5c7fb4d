"""bppsa.nn.Sequential against torch.nn.Sequential: the same state dict, the same gradients (issue 42).

Every listed layer, LeNet-5, a width-scaled VGG-11 and random chains (odd sizes, stride 2, padding 2, overlapping
pools) at fp64 <= 1e-10 and fp32 <= 1e-4 relative error; torch.autograd.gradcheck on small chains.  Each exactness
test runs on the CPU and, with the gpu marker, on a CUDA device where one is present.
"""
import pytest
import torch
from torch import nn

import bppsa.nn as bnn
from bppsa.jacobians import operators
from bppsa.models.cnn import lenet5, vgg11_chain
from bppsa.models.vgg import VGG11
from bppsa.precision import TOLERANCE

TOL = {torch.float64: TOLERANCE["float64"], torch.float32: TOLERANCE["float32"]}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rel(got, ref) -> float:
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def _compare(layers, x, *, dtype=torch.float64, device="cpu", L_m=None, drop_zeros=False, seed=0, input_grad=True):
    """Loss gradients of every parameter (and the input) by autograd through torch.nn.Sequential and by the scan
    through bppsa.nn.Sequential, on the same weights, batch and dropout draw; returns the largest relative error."""
    ref = nn.Sequential(*[_copy(m) for m in layers]).to(device=device, dtype=dtype)
    ours = bnn.Sequential(*[_copy(m) for m in layers], L_m=L_m, drop_zeros=drop_zeros).to(device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = x.to(device=device, dtype=dtype)
    outs, grads = [], []
    for net in (ref, ours):
        xi = x.clone().requires_grad_(input_grad)
        torch.manual_seed(seed)
        y = net(xi)
        w = torch.linspace(-1, 1, y.numel(), dtype=dtype, device=device).reshape(y.shape)
        (y * w).sum().backward()  # every output element gets its own gradient
        outs.append(y.detach())
        grads.append([p.grad for p in net.parameters()] + ([xi.grad] if input_grad else []))
    assert torch.equal(outs[0], outs[1])  # the forward is torch's own
    errs = [_rel(g, r) for g, r in zip(grads[1], grads[0], strict=True)]
    assert errs, "nothing was compared"
    return max(errs)


def _copy(m):
    import copy

    return copy.deepcopy(m)


LAYERS = {
    "conv-stride2-pad2": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=2), (3, 9, 7)),
    "conv-dilated-grouped": (lambda: nn.Conv2d(4, 6, (3, 2), stride=(1, 2), padding=(1, 0), dilation=2, groups=2),
                             (4, 9, 8)),
    "conv-depthwise-nobias": (lambda: nn.Conv2d(3, 3, 5, padding=2, groups=3, bias=False), (3, 7, 7)),
    "conv-same": (lambda: nn.Conv2d(2, 3, 3, padding="same"), (2, 5, 6)),
    "relu": (nn.ReLU, (2, 5, 3)),
    "leaky-relu": (lambda: nn.LeakyReLU(0.2), (2, 5, 3)),
    "tanh": (nn.Tanh, (2, 5, 3)),
    "maxpool-overlapping-padded": (lambda: nn.MaxPool2d(3, 2, padding=1), (2, 9, 7)),
    "maxpool-dilated-ceil": (lambda: nn.MaxPool2d(2, 2, dilation=2, ceil_mode=True), (2, 9, 8)),
    "avgpool-padded": (lambda: nn.AvgPool2d(3, 2, padding=1, count_include_pad=False), (2, 9, 7)),
    "avgpool-ceil": (lambda: nn.AvgPool2d(2, ceil_mode=True), (2, 7, 5)),
    "flatten": (nn.Flatten, (2, 3, 5)),
    "linear": (lambda: nn.Linear(7, 5), (7,)),
    "dropout": (lambda: nn.Dropout(0.4), (3, 5, 5)),
    "batchnorm-eval": (lambda: _bn(3), (3, 5, 4)),
}


def _bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return bn.eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_layer_equals_autograd(name, dtype, device):
    make, shape = LAYERS[name]
    torch.manual_seed(1)
    layer = make()
    x = torch.randn(3, *shape)
    if name == "maxpool-overlapping-padded":
        x = x.round()  # ties: the winner must be the one autograd sends the gradient to
    # the layer alone, and between a conv and a linear layer (its Jacobian inside the scan's products)
    assert _compare([layer], x, dtype=dtype, device=device) <= TOL[dtype]
    if len(shape) == 3:
        torch.manual_seed(2)
        pre = nn.Conv2d(shape[0], shape[0], 1)
        with torch.no_grad():
            n_out = nn.Sequential(_copy(pre), _copy(layer)).eval()(x[:1]).numel()
        flat = [] if name == "flatten" else [nn.Flatten()]
        chain = [pre, layer, *flat, nn.Linear(n_out, 3)]
        for L_m in (None, 0):
            assert _compare(chain, x, dtype=dtype, device=device, L_m=L_m) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, L_m", [(torch.float64, None), (torch.float32, None), (torch.float64, 2)])
def test_lenet5_equals_autograd(dtype, L_m, device):
    torch.manual_seed(0)
    x = torch.randn(3, 3, 32, 32)
    assert _compare(list(lenet5()), x, dtype=dtype, device=device, L_m=L_m, input_grad=False) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_width_scaled_vgg11_equals_autograd(dtype, device):
    torch.manual_seed(0)
    chain = vgg11_chain(VGG11(width=1 / 16))
    x = torch.randn(2, 3, 32, 32)
    assert _compare(list(chain), x, dtype=dtype, device=device, input_grad=False) <= TOL[dtype]


def _random_chain(seed: int):
    """conv / activation / pool blocks with odd sizes, stride 2, padding 2, overlapping pools, then a classifier."""
    g = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    c, size = pick(1, 2, 3), pick(11, 13, 15)
    x_shape = (c, size, size)
    layers = []
    for _ in range(pick(2, 3)):
        co, k, s, p = pick(2, 3, 5), pick(1, 3, 5), pick(1, 2), pick(0, 1, 2)
        if size + 2 * p < k:
            p = k
        layers.append(nn.Conv2d(c, co, k, stride=s, padding=p))
        size = (size + 2 * p - k) // s + 1
        c = co
        layers.append(pick(nn.ReLU(), nn.Tanh(), nn.LeakyReLU(0.1)))
        if size >= 3:
            pk, ps = pick((3, 2), (2, 1), (3, 1), (2, 2))  # overlapping where the stride is below the window
            pp = pick(0, 1) if pk == 3 else 0
            layers.append(pick(nn.MaxPool2d(pk, ps, padding=pp), nn.AvgPool2d(pk, ps, padding=pp)))
            size = (size + 2 * pp - pk) // ps + 1
    layers += [nn.Flatten(), nn.Linear(c * size * size, 7), nn.ReLU(), nn.Linear(7, 3)]
    return layers, x_shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_random_chains_equal_autograd(seed, device):
    torch.manual_seed(seed)
    layers, shape = _random_chain(seed)
    x = torch.randn(3, *shape)
    L_m = [None, 0, 1, 2][seed % 4]
    assert _compare(layers, x, dtype=torch.float64, device=device, L_m=L_m) <= TOL[torch.float64]
    assert _compare(layers, x, dtype=torch.float32, device=device, L_m=L_m) <= TOL[torch.float32]


@pytest.mark.parametrize("drop_zeros", [False, True])
def test_gradcheck_small_chains(drop_zeros):
    torch.manual_seed(0)
    net = bnn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=2), nn.Tanh(), nn.AvgPool2d(2, 1),
                         nn.Conv2d(3, 2, 2, dilation=2), nn.LeakyReLU(0.3), nn.Flatten(), nn.Linear(4, 3),
                         L_m=1, drop_zeros=drop_zeros).double()
    x = torch.randn(2, 2, 7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(net, (x,), eps=1e-6, atol=1e-7, fast_mode=True)
    params = list(net.parameters())

    def f(x, *ps):
        with torch.nn.utils.stateless._reparametrize_module(net, dict(zip([n for n, _ in net.named_parameters()], ps))):
            return net(x)

    assert torch.autograd.gradcheck(f, (x, *[p.detach().clone().requires_grad_(True) for p in params]), eps=1e-6,
                                    atol=1e-7, fast_mode=True)


def test_pruned_weights_dropped_give_the_same_gradients():
    torch.manual_seed(0)
    layers = list(lenet5())
    with torch.no_grad():
        for m in layers:
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight[m.weight.abs() < m.weight.abs().median()] = 0.0
    x = torch.randn(2, 3, 32, 32)
    assert _compare(layers, x, drop_zeros=True, input_grad=False) <= TOL[torch.float64]


def test_dropout_draws_torchs_mask():
    torch.manual_seed(5)
    x = torch.randn(4, 10)
    ref, ours = nn.Dropout(0.3), bnn.Sequential(nn.Dropout(0.3))
    torch.manual_seed(9)
    a = ref(x)
    torch.manual_seed(9)
    b = ours(x.requires_grad_(True))
    assert torch.equal(a, b) and (a == 0).any()


def test_unsupported_layer_is_refused_by_name_before_any_work():
    with pytest.raises(ValueError, match=r"layer '1' \(GELU\) has no transposed-Jacobian operator"):
        bnn.Sequential(nn.Linear(3, 3), nn.GELU())
    with pytest.raises(ValueError, match="return_indices"):
        bnn.Sequential(nn.MaxPool2d(2, return_indices=True))
    with pytest.raises(ValueError, match="start_dim=0"):
        bnn.Sequential(nn.Flatten(0))
    with pytest.raises(ValueError, match="L_m"):
        bnn.Sequential(nn.ReLU(), L_m=-1)
    net = bnn.Sequential(nn.Linear(3, 3))
    net.append(nn.Softmax(dim=1))  # added after construction: refused at the call
    calls = []
    net[0].register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"layer '1' \(Softmax\)"):
        net(torch.randn(2, 3, requires_grad=True))
    assert not calls  # no layer ran
    with pytest.raises(ValueError, match=r"layer '0' \(Linear\).*Flatten before it"):  # refused in the forward
        bnn.Sequential(nn.Linear(3, 2))(torch.randn(2, 4, 3, requires_grad=True))
    bn = bnn.Sequential(nn.BatchNorm2d(2))  # training mode: refused when it runs
    with pytest.raises(ValueError, match=r"layer '0' \(BatchNorm2d\).*eval"):
        bn(torch.randn(2, 2, 3, 3, requires_grad=True))


def test_a_drop_in_for_torch_sequential():
    torch.manual_seed(0)
    ref = lenet5()
    ours = bnn.Sequential.from_torch(ref, L_m=2)
    assert isinstance(ours, nn.Sequential) and ours[0] is ref[0]  # the same layers, shared
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    assert "L_m=2" in repr(ours)
    with pytest.raises(TypeError, match="torch.nn.Sequential"):
        bnn.Sequential.from_torch(nn.Linear(2, 2))


def test_registry_is_the_one_generator():
    """Table 1, the FLOP analysis and the layer use the registry; no other module builds a Jacobian."""
    from pathlib import Path

    src = Path(operators.__file__).resolve().parents[1]
    for path in src.rglob("*.py"):
        text = path.read_text()
        if path.name != "operators.py":
            assert "def conv2d_jacobian_t" not in text and "def maxpool2d_jacobian_t" not in text, path
    assert {"Conv2d", "ReLU", "LeakyReLU", "Tanh", "MaxPool2d", "AvgPool2d", "Flatten", "Linear", "Dropout",
            "BatchNorm2d"} <= set(operators.supported_names())


def test_the_readme_example_runs():
    """README's five-line bppsa.nn.Sequential example, as written."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "bppsa.nn.Sequential(" in b]
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert all(p.grad is not None for p in scope["net"].parameters())


def test_the_products_fast_paths_are_the_sparse_product():
    """A row gather (left operand one entry per row) and a column scaling (right operand diagonal, entries missing
    where a ReLU dropped them) give the matrix torch's sparse product gives, explicit zeros included."""
    from bppsa.nn.sequential import spmm, spmv

    g = torch.Generator().manual_seed(0)
    dense = torch.randn(7, 6, dtype=torch.float64, generator=g) * (torch.rand(7, 6, generator=g) < 0.5)
    a = dense.to_sparse_csr()
    diag = torch.diag(torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 3.0], dtype=torch.float64))
    d = torch.sparse_csr_tensor(torch.tensor([0, 1, 1, 2, 3, 4, 5]), torch.tensor([0, 2, 3, 4, 5]),
                                torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0], dtype=torch.float64), (6, 6),
                                check_invariants=True)
    sel = torch.sparse_csr_tensor(torch.tensor([0, 1, 1, 2, 3]), torch.tensor([3, 0, 6]),
                                  torch.tensor([2.0, 0.0, -1.5], dtype=torch.float64), (4, 7), check_invariants=True)
    assert torch.equal(spmm(a, d).to_dense(), dense @ diag)
    assert torch.equal(spmm(sel, a).to_dense(), sel.to_dense() @ dense)
    assert spmm(sel, a)._nnz() == (a.crow_indices().diff()[[3, 0, 6]]).sum()  # the zero-scaled row kept, explicit
    v = torch.randn(6, dtype=torch.float64, generator=g)
    assert torch.allclose(spmv(a, v), dense @ v)
    empty = torch.sparse_csr_tensor(torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(0, dtype=torch.float64), (2, 7), check_invariants=True)
    assert spmm(empty, a).shape == (2, 6) and spmm(empty, a)._nnz() == 0
    # int32 indices (what cuSPARSE's SpGEMM returns) come out as int64, as the operators build them
    a32 = torch.sparse_csr_tensor(a.crow_indices().int(), a.col_indices().int(), a.values(), a.shape,
                                  check_invariants=True)
    for out in (spmm(a32, d), spmm(sel, a32), spmm(a32, a32.t().to_sparse_csr())):
        assert out.crow_indices().dtype == out.col_indices().dtype == torch.int64
    assert torch.equal(spmm(sel, a32).to_dense(), sel.to_dense() @ dense)
