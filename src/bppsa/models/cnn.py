"""The feed-forward networks BPPSA trains through ``bppsa.nn.Sequential``: LeNet-5 (the paper's Fig 6) and VGG-11
laid out as one flat chain of layers (the pruned-retraining measurement of Sec 4.3)."""
from __future__ import annotations

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
