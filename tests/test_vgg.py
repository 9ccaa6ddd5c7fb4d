"""VGG-11 plan, magnitude pruning, masked retraining, CIFAR-10 parsing and the stand-in label."""
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from bppsa.data import cifar
from bppsa.models import vgg


def test_vgg11_plan():
    m = vgg.VGG11(width=1.0)
    convs = [l.out_channels for l in m.features if isinstance(l, nn.Conv2d)]
    assert convs == [64, 128, 256, 256, 512, 512, 512, 512]
    assert sum(isinstance(l, nn.MaxPool2d) for l in m.features) == 5
    assert m.classifier.in_features == 512 and m.classifier.out_features == 10
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert [l.out_channels for l in vgg.VGG11(width=0.25).features if isinstance(l, nn.Conv2d)][0] == 16


@pytest.mark.parametrize("scheme", vgg.SCHEMES)
@pytest.mark.parametrize("fraction", [0.5, 0.97])
def test_pruning_leaves_exactly_the_fraction(scheme, fraction):
    torch.manual_seed(0)
    m = vgg.VGG11(width=0.125)
    masks = vgg.magnitude_masks(m, fraction, scheme)
    vgg.apply_masks(m, masks)
    params = vgg.prunable(m)
    total = sum(p.numel() for _, p in params)
    zeros = sum(int((p == 0).sum()) for _, p in params)
    if scheme == "class-uniform":
        for _, p in params:
            assert int((p == 0).sum()) == round(fraction * p.numel())
    else:
        assert zeros == round(fraction * total)
    # magnitude: every kept weight is at least as large as every pruned one (globally or per layer)
    torch.manual_seed(0)
    o = dict(vgg.VGG11(width=0.125).named_parameters())  # the same initial weights, unpruned
    flat_kept = torch.cat([o[n].abs()[masks[n]] for n in masks])
    flat_cut = torch.cat([o[n].abs()[~masks[n]] for n in masks])
    if scheme == "class-blind":
        assert flat_kept.min() >= flat_cut.max()
    else:
        for n in masks:
            assert o[n].abs()[masks[n]].min() >= o[n].abs()[~masks[n]].max()
    assert vgg.pruned_fraction(m)["all"] == pytest.approx(zeros / total)


def test_retraining_keeps_pruned_weights_zero():
    torch.manual_seed(0)
    m = vgg.VGG11(width=0.0625)
    masks = vgg.magnitude_masks(m, 0.9)
    X, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    vgg.train(m, X, y, vgg.TrainConfig(epochs=1, batch_size=16, lr=0.05, augment=True), masks=masks)
    for name, p in vgg.prunable(m):
        assert torch.all(p[~masks[name]] == 0)
        assert torch.count_nonzero(p[masks[name]]) > 0


def test_standin_is_labelled():
    d = cifar.load("standin")
    assert d.standin and "stand-in" in d.name
    assert d.x_train.shape[1:] == (3, 32, 32) and d.x_test.shape[1:] == (3, 32, 32)
    assert len(d.y_train) + len(d.y_test) == 1797 and set(d.y_train.tolist()) == set(range(10))


def _write_batch(path, n=4, bad=False):
    data = {b"data": np.zeros((n, 3072 if not bad else 100), np.uint8), b"labels": list(range(n))}
    with open(path, "wb") as f:
        pickle.dump(data, f)


def test_cifar_parsing_and_corrupt_file_named(tmp_path):
    folder = tmp_path / cifar.FOLDER
    folder.mkdir()
    for name in cifar.TRAIN_BATCHES + (cifar.TEST_BATCH,):
        _write_batch(folder / name)
    d = cifar.load(str(tmp_path))
    assert not d.standin and d.name == "CIFAR-10" and d.x_train.shape == (20, 3, 32, 32)
    _write_batch(folder / "data_batch_3", bad=True)
    with pytest.raises(cifar.CorruptFile, match="data_batch_3"):
        cifar.load(str(tmp_path))
    (folder / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(cifar.CorruptFile, match="data_batch_3"):
        cifar.load(str(tmp_path))
    (folder / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch"):
        cifar.load(str(tmp_path))


def test_bad_tarball_named(tmp_path):
    tb = tmp_path / "cifar-10-python.tar.gz"
    tb.write_bytes(b"not a tarball")
    with pytest.raises(cifar.CorruptFile, match="cifar-10-python.tar.gz"):
        cifar.load(str(tb), root=tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="cifar10.source"):
        cifar.load(str(tmp_path / "missing"))
