import numpy as np
import pytest

from bppsa.data import DatasetError, bitstream
from bppsa.data.sequences import open_dataset


def test_format_and_determinism(tmp_path):
    p1, p2 = tmp_path / "a.npz", tmp_path / "b.npz"
    bitstream.write(p1, seq_len=21, samples=300, seed=7)
    bitstream.write(p2, seq_len=21, samples=300, seed=7)
    with np.load(p1) as z1, np.load(p2) as z2:
        assert z1["x_bits"].dtype == np.uint8 and z1["x_bits"].shape == (300, 3)  # ceil(21/8)
        assert z1["y"].dtype == np.uint8 and z1["y"].shape == (300,)
        assert int(z1["seq_len"]) == 21
        assert np.array_equal(z1["x_bits"], z2["x_bits"]) and np.array_equal(z1["y"], z2["y"])
    bitstream.write(p2, seq_len=21, samples=300, seed=8)
    with np.load(p1) as z1, np.load(p2) as z2:
        assert not np.array_equal(z1["x_bits"], z2["x_bits"])


def test_rates_follow_eq8(tmp_path):
    """x_t ~ Bernoulli(0.05 + 0.1 c): the per-class mean bit rate is within sampling error."""
    x_bits, y = bitstream.generate(seq_len=2000, samples=3000, seed=0, progress=False)
    bits = np.unpackbits(x_bits, axis=1, count=2000)
    assert set(np.unique(y)) == set(range(10))
    for c in range(10):
        rate = bits[y == c].mean()
        n = bits[y == c].size
        p = 0.05 + 0.1 * c
        assert abs(rate - p) < 5 * np.sqrt(p * (1 - p) / n), (c, rate)
    counts = np.bincount(y, minlength=10)
    assert counts.min() > 3000 / 10 * 0.7  # roughly uniform classes


def test_batch_is_time_major_and_unpacked(tmp_path):
    p = tmp_path / "T13.npz"
    bitstream.write(p, seq_len=13, samples=20, seed=1)
    ds = open_dataset(p)
    x, y = ds.get_batch(np.arange(4))
    assert x.shape == (13, 4, 1) and y.shape == (4,)
    x_bits, yy, T = bitstream.load(p)
    assert np.array_equal(x[:, 0, 0].numpy().astype(np.uint8), np.unpackbits(x_bits[0], count=13))
    assert ds.n == 20 and ds.seq_len == 13 and ds.input_size == 1 and ds.classes == 10


def test_truncated_file_is_named(tmp_path):
    p = tmp_path / "T100.npz"
    bitstream.write(p, seq_len=100, samples=64, seed=0)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="T100.npz"):
        bitstream.load(p)
    with pytest.raises(DatasetError, match="T100.npz"):
        open_dataset(p)


def test_inconsistent_file_is_named(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, x_bits=np.zeros((5, 2), np.uint8), y=np.zeros(5, np.uint8), seq_len=np.int64(100))
    with pytest.raises(DatasetError, match="bad.npz.*x_bits"):
        bitstream.load(p)
    with pytest.raises(DatasetError, match="no such dataset file"):
        bitstream.load(tmp_path / "missing.npz")


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    p = tmp_path / "T50.npz"

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(KeyboardInterrupt):
        bitstream.write(p, seq_len=50, samples=10)
    assert list(tmp_path.iterdir()) == []
