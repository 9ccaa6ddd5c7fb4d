"""The feed-forward networks BPPSA trains through ``bppsa.nn.Sequential``: LeNet-5 (the paper's Fig 6) and VGG-11
laid out as one flat chain of layers (the pruned-retraining measurement of Sec 4.3)."""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from .vgg import VGG11


def lenet5(classes: int = 10, in_channels: int = 3, image_size: int = 32) -> nn.Sequential:
    """LeNet-5 as the paper trains it on CIFAR-10 (PyTorch's CIFAR-10 tutorial network): two 5x5 convolutions with
    ReLU and 2x2 max-pooling, then 120-84-classes fully connected layers with ReLU."""
    side = ((image_size - 4) // 2 - 4) // 2
    if side < 1:
        raise ValueError(f"image size {image_size} is too small for LeNet-5 (at least 16)")
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * side * side, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, classes),
    )


def vgg11_chain(model: VGG11) -> nn.Sequential:
    """``model``'s layers as one ``nn.Sequential`` (features, a Flatten, the classifier): the same module objects,
    so the parameters are shared with ``model`` (a checkpoint loaded into it is the chain's)."""
    return nn.Sequential(*model.features, nn.Flatten(), model.classifier)


def train_curves(make_model, data, *, methods: dict, iterations: int, batch_size: int, lr: float, momentum: float,
                 test_every: int, test_samples: int, seed: int, dtype=torch.float32, device="cpu",
                 log=None) -> list[dict]:
    """Fig 6: the same network trained by each of ``methods`` (name -> ``net -> net to train``: the identity for
    autograd, ``bppsa.nn.Sequential.from_torch`` for BPPSA) from the same initial weights and the same batches,
    SGD with momentum; the training loss of every iteration and the test loss every ``test_every`` iterations
    (and after the last), on the first ``test_samples`` test images (0: all).

    Returns one row per (method, split, iteration): ``loss`` and the method's cumulative wall-clock.
    """
    torch.manual_seed(seed)
    init = make_model().to(device=device, dtype=dtype)
    n = len(data.y_train)
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(-(-iterations * batch_size // n) + 1)])
    xt = data.x_test if not test_samples else data.x_test[:test_samples]
    yt = data.y_test if not test_samples else data.y_test[:test_samples]
    xt, yt = xt.to(device=device, dtype=dtype), yt.to(device)
    rows = []
    for name, wrap in methods.items():
        net = wrap(copy.deepcopy(init))
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        spent = 0.0
        for it in range(1, iterations + 1):
            idx = order[(it - 1) * batch_size: it * batch_size]
            xb, yb = data.x_train[idx].to(device=device, dtype=dtype), data.y_train[idx].to(device)
            t0 = time.perf_counter()
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if xb.is_cuda:
                torch.cuda.synchronize(xb.device)
            spent += time.perf_counter() - t0
            rows.append(dict(method=name, split="train", iteration=it, loss=loss.item(), wall_clock_s=spent))
            if it % test_every == 0 or it == iterations:
                with torch.no_grad():
                    test = sum(F.cross_entropy(net(xt[i:i + 500]), yt[i:i + 500], reduction="sum").item()
                               for i in range(0, len(yt), 500)) / len(yt)
                rows.append(dict(method=name, split="test", iteration=it, loss=test, wall_clock_s=spent))
                if log is not None:
                    log(name, it, rows[-2]["loss"], test)
    return rows
