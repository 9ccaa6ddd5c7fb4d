"""VGG-11 for 32x32 images (the CIFAR variant), magnitude pruning (See et al., 2016) and retraining.

The conv part is a plain chain of Conv2d(3x3, padding 1) -> ReLU [-> MaxPool2d(2, 2)], so its
transposed Jacobians are three operators of :mod:`bppsa.jacobians.operators`; the
classifier is one linear layer, as in the common CIFAR VGG.  No batch norm: the paper's Jacobian
chain (Sec 4.3, Fig 3) has convolutions, ReLUs and max-pools only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

VGG11_CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
SCHEMES = ("class-uniform", "class-blind")


def scaled_cfg(width: float) -> tuple:
    """The VGG-11 plan with every conv width multiplied by ``width`` (at least one channel)."""
    if width <= 0:
        raise ValueError(f"width multiplier must be > 0, got {width}")
    return tuple(c if c == "M" else max(1, int(round(c * width))) for c in VGG11_CFG)


class VGG11(nn.Module):
    def __init__(self, width: float = 1.0, classes: int = 10, in_channels: int = 3, image_size: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        c, size = in_channels, image_size
        for v in scaled_cfg(width):
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                size //= 2
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
                c = v
        if size < 1:
            raise ValueError(f"image size {image_size} is too small for VGG-11's five 2x2 poolings")
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c * size * size, classes)
        self.image_size = image_size
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # He init keeps activations from vanishing through eight plain conv+ReLU layers
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def feature_shapes(width: float, image_size: int = 32, in_channels: int = 3) -> list[tuple[str, tuple]]:
    """(layer kind, output shape C×H×W) of VGG-11's conv part, in order."""
    out, c, size = [], in_channels, image_size
    for v in scaled_cfg(width):
        if v == "M":
            size //= 2
            out.append(("pool", (c, size, size)))
        else:
            c = v
            out += [("conv", (c, size, size)), ("relu", (c, size, size))]
    return out


def prunable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The weights that pruning touches: every conv and linear weight (biases are kept)."""
    return [
        (f"{name}.weight", m.weight)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]


def _keep_mask(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Mask zeroing exactly round(fraction * n) of the smallest scores (stable: ties by position)."""
    n = scores.numel()
    k = int(round(fraction * n))
    mask = torch.ones(n, dtype=torch.bool)
    if k:
        order = torch.from_numpy(np.argsort(scores.detach().cpu().numpy().reshape(-1), kind="stable"))
        mask[order[:k]] = False
    return mask


def magnitude_masks(model: nn.Module, fraction: float, scheme: str = "class-uniform") -> dict[str, torch.Tensor]:
    """Magnitude pruning masks (True = kept) for every conv and linear weight.

    ``class-uniform`` prunes ``fraction`` of each layer's weights (See et al.'s per-class scheme,
    and the paper's "97% of the weights of every conv and linear layer"); ``class-blind`` prunes
    ``fraction`` of all these weights together with one global magnitude threshold.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"prune fraction must be in [0, 1), got {fraction}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown pruning scheme '{scheme}' (choose from {', '.join(SCHEMES)})")
    params = prunable(model)
    if scheme == "class-uniform":
        return {name: _keep_mask(p.abs(), fraction).view_as(p) for name, p in params}
    flat = torch.cat([p.detach().abs().reshape(-1) for _, p in params])
    keep = _keep_mask(flat, fraction)
    out, start = {}, 0
    for name, p in params:
        out[name] = keep[start : start + p.numel()].view_as(p)
        start += p.numel()
    return out


@torch.no_grad()
def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, m in masks.items():
        params[name].mul_(m.to(params[name].device, params[name].dtype))


def pruned_fraction(model: nn.Module) -> dict[str, float]:
    """Fraction of exactly-zero weights per prunable layer, plus 'all'."""
    out, zeros, total = {}, 0, 0
    for name, p in prunable(model):
        z = int((p == 0).sum())
        out[name] = z / p.numel()
        zeros += z
        total += p.numel()
    out["all"] = zeros / total
    return out


@dataclass
class TrainConfig:
    epochs: int
    batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    augment: bool = True
    seed: int = 0


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random horizontal flip and random 32x32 crop of a 4-pixel zero-padded image (the usual CIFAR recipe)."""
    B, _, H, W = x.shape
    flip = torch.rand(B, generator=gen) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    pad = nn.functional.pad(x, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (B,), generator=gen)
    dx = torch.randint(0, 9, (B,), generator=gen)
    rows = (dy[:, None] + torch.arange(H)[None]).view(B, 1, H, 1).expand(B, x.shape[1], H, W + 8)
    x = pad.gather(2, rows)
    cols = (dx[:, None] + torch.arange(W)[None]).view(B, 1, 1, W).expand(B, x.shape[1], H, W)
    return x.gather(3, cols)


@torch.no_grad()
def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int = 500) -> float:
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for i in range(0, len(X), batch_size):
        correct += int((model(X[i : i + batch_size].to(device)).argmax(1).cpu() == y[i : i + batch_size]).sum())
    return correct / max(1, len(X))


def train(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    masks: dict[str, torch.Tensor] | None = None,
    log=None,
) -> list[dict]:
    """SGD with momentum and a cosine schedule; with ``masks`` the pruned weights stay exactly zero.

    Returns one record per epoch (mean training loss, seconds).
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(X) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.epochs * steps_per_epoch))
    loss_fn = nn.CrossEntropyLoss()
    if masks is not None:
        apply_masks(model, masks)
    history = []
    for epoch in range(cfg.epochs):
        model.train()
        t0, total, seen = time.perf_counter(), 0.0, 0
        perm = torch.randperm(len(X), generator=gen)
        for i in range(0, len(X), cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            xb = X[idx]
            if cfg.augment:
                xb = _augment(xb, gen)
            xb, yb = xb.to(device), y[idx].to(device)
            loss = loss_fn(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if masks is not None:
                # momentum and weight decay would otherwise revive pruned weights
                apply_masks(model, masks)
            total += loss.item() * len(idx)
            seen += len(idx)
        rec = {"epoch": epoch + 1, "train_loss": total / seen, "seconds": time.perf_counter() - t0}
        history.append(rec)
        if log is not None:
            log(rec)
    return history
