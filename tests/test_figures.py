"""What a reader sees: log axes labelled in plain numbers, Fig 9's labels clear of the bars and of each other,
and every legend naming the backend the CSVs say measured each line."""
import re

import numpy as np
import pandas as pd
import pytest

from bppsa.analysis import speedups
from bppsa.plots import common, gru, rnn

PLAIN = re.compile(r"^\d+(\.\d+)?×?$")


@pytest.mark.parametrize("lo, hi, want", [
    (0.22, 12.0, [0.5, 1, 2, 5, 10]),
    (0.55, 0.95, [0.6, 0.7, 0.8, 0.9]),   # under one decade: denser, still plain
    (1.0, 1e5, [1, 10, 100, 1000, 10000, 100000]),  # many decades: one tick each
])
def test_nice_log_ticks_fall_inside_the_range(lo, hi, want):
    assert common.nice_log_ticks(lo, hi) == pytest.approx(want)


def test_a_speedup_axis_reads_in_plain_numbers():
    fig, ax = common.plt.subplots()
    ax.plot([1, 2, 3], [0.3, 1.0, 12.0])
    ax.set_yscale("log")
    ticks = common.plain_log_axis(ax, "y", unit="×")
    fig.canvas.draw()
    major = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    minor = [t.get_text() for t in ax.yaxis.get_ticklabels(minor=True) if t.get_text()]
    common.plt.close(fig)
    assert major == ["0.5×", "1×", "2×", "5×", "10×"] and ticks == pytest.approx([0.5, 1, 2, 5, 10])
    assert minor == []  # matplotlib would write '6 × 10⁻¹' here
    assert common.plain_number(0.05, "×") == "0.05×" and common.plain_number(1500.0) == "1500"


def _bench(model, T, B, phases, backends, data="bitstream (Eq. 8)", iters=8):
    rng = np.random.default_rng(T * 1000 + B)
    rows = []
    for variant, ph in phases.items():
        for mode in ("full", "nobp"):
            for i in range(iters):
                f = rng.lognormal(0, 0.03)
                for name, sec in ph.items():
                    if mode == "nobp" and name not in ("forward", "jacobian"):
                        continue
                    rows.append(dict(variant=variant, mode=mode, iter=i, phase=name, seconds=sec * f,
                                     method=variant.split("-")[0], layout=variant[6:] if "-" in variant else "",
                                     backend=backends[variant], noisy=False, profile="test", device="cpu",
                                     model=model, seq_len=T, batch=B, data=data, reference="baseline", conf=0.95,
                                     noisy_threshold=0.1, stopped_by="stable", rounds=iters))
    return rows


BACKENDS = {"baseline": "my-autograd", "bppsa-fused": "my-fast-path"}  # names no code hard-codes


def _capture(monkeypatch, module):
    figs = []
    monkeypatch.setattr(module, "save", lambda fig, out: figs.append(fig))
    return figs


def test_rnn_figures_plain_speedup_ticks_and_the_backends_in_the_legends(monkeypatch):
    rows = []
    for T, s in ((10, 0.3), (100, 1.5), (1000, 9.0)):
        base = {"forward": 1e-4, "backward": 1e-3, "optimizer": 1e-5}
        rows += _bench("rnn", T, 16, {"baseline": base, "bppsa-fused": {"forward": 1e-4, "jacobian": 3e-4 / s,
                                                                         "backward": 7e-4 / s, "optimizer": 1e-5}},
                       BACKENDS)
    bench = pd.DataFrame(rows)
    sp = speedups.speedups(bench).assign(device_label="cpu")
    lat = speedups.latency(bench).assign(device_label="cpu")
    figs = _capture(monkeypatch, rnn)
    rnn.fig_speedup(sp, "seq_len", "x.png")
    rnn.fig_latency(lat, "seq_len", "x.png")
    rnn.fig_breakdown(lat, "seq_len", "x.png")
    (f_sp, f_lat, f_bd) = figs
    for fig in figs:
        fig.canvas.draw()
    ax = f_sp.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(PLAIN.match(t) for t in labels), labels
    assert "1×" in labels and not [t for t in ax.yaxis.get_ticklabels(minor=True) if t.get_text()]
    legend = " / ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "my-fast-path vs my-autograd" in legend
    lat_ax = f_lat.axes[0]
    assert all(PLAIN.match(t.get_text()) for t in lat_ax.get_yticklabels() if t.get_text())
    lat_legend = [t.get_text() for t in lat_ax.get_legend().get_texts()]
    assert any("my-autograd" in t and t.startswith("baseline") for t in lat_legend)
    assert any("backend my-fast-path" in t and t.startswith("BPPSA") for t in lat_legend)
    bd_legend = " / ".join(t.get_text() for t in f_bd.axes[0].get_legend().get_texts())
    assert "my-autograd" in bd_legend and "my-fast-path" in bd_legend
    for fig in figs:
        common.plt.close(fig)


def _gru_tables(configs):
    rows = []
    for (T, B), s in configs.items():
        base = {"forward": 0.3e-3 * T / 259, "backward": 1.0e-3 * T / 259, "optimizer": 0.05e-3}
        bp = {"forward": base["forward"], "jacobian": 0.4 * base["backward"] / s,
              "backward": 0.6 * base["backward"] / s, "optimizer": 0.05e-3}
        rows += _bench("gru", T, B, {"baseline": base, "bppsa-fused": bp}, BACKENDS,
                       data="synthetic IRMAS stand-in")
    bench = pd.DataFrame(rows)
    return speedups.latency(bench).assign(device_label="cpu"), speedups.speedups(bench).assign(device_label="cpu")


def _boxes(fig, ax):
    r = fig.canvas.get_renderer()
    labels = [t.get_window_extent(r) for t in ax.texts]
    bars = [p.get_window_extent(r) for p in ax.patches if p.get_height() > 0]
    return labels, bars


def test_fig_9_labels_clear_the_bars_each_other_and_the_frame(monkeypatch):
    """The default profile's nine configurations, one of them with BPPSA slower than the baseline (its bar
    above 1): every label sits above both bars of its configuration, inside the axes, apart from the others."""
    sets = {"s": 259, "m": 517, "l": 1034}
    configs = {(T, B): 2.5 * (T / 259) ** 0.5 * (16 / B) ** 0.7 for T in sets.values() for B in (16, 32, 64)}
    configs[(259, 64)] = 0.6
    lat, sp = _gru_tables(configs)
    figs = _capture(monkeypatch, gru)
    gru.fig_9(lat, sp, "x.png")
    (fig,) = figs
    fig.tight_layout()  # what save() does before writing
    fig.canvas.draw()
    ax = fig.axes[0]
    labels, bars = _boxes(fig, ax)
    assert len(labels) == 9
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    for i, a in enumerate(labels):
        assert frame.y0 <= a.y0 and a.y1 <= frame.y1 + 0.5, "a label leaves the axes"
        assert not any(a.overlaps(b) for b in bars), "a label covers a bar"
        assert not any(a.overlaps(b) for b in labels[i + 1:]), "two labels overlap"
    legend = " / ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "my-autograd" in legend and "my-fast-path" in legend
    common.plt.close(fig)


def _curve(method, dtype, losses, backend):
    return pd.DataFrame(dict(epoch=np.arange(1, len(losses) + 1), wall_clock_s=np.arange(1, len(losses) + 1) * 2.0,
                             loss=losses, accuracy=0.3, steps=64, profile="test", device="cpu", model="rnn",
                             method=method, backend=backend, layout="fused" if method == "bppsa" else "",
                             dtype=dtype, seq_len=1000, batch=16, hidden=20, lr=1e-3, samples=1024,
                             data="bitstream (Eq. 8)"))


def test_fig_7_draws_and_labels_the_float64_twin(monkeypatch):
    base = np.array([2.3, 2.0, 1.9, 1.8, 1.75, 1.74, 1.88, 1.72])
    curves = pd.concat([_curve("baseline", "float32", base, "my-autograd"),
                        _curve("bppsa", "float32", base * (1 + np.array([0, 1e-8, 1e-7, 1e-5, 1e-3, 0.02, 0.05, 0.03])),
                               "my-fast-path"),
                        _curve("baseline", "float64", base, "my-autograd"),
                        _curve("bppsa", "float64", base * (1 + 1e-15), "my-fast-path")]).assign(device_label="cpu")
    figs = _capture(monkeypatch, rnn)
    rnn.fig_7(curves, "x.png")
    (fig,) = figs
    loss_ax, _, diff_ax = fig.axes
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]  # the workflow's float32 curves
    assert len(legend) == 2 and not any("float64" in t for t in legend)
    assert any("backend my-fast-path" in t for t in legend) and any("my-autograd" in t for t in legend)
    diff_legend = [t.get_text() for t in diff_ax.get_legend().get_texts()]  # one line per precision
    assert len(diff_legend) == 2 and all("my-fast-path" in t and "my-autograd" in t for t in diff_legend)
    assert sorted("float64" in t for t in diff_legend) == [False, True]
    assert "float64" in fig._suptitle.get_text()
    common.plt.close(fig)


def test_the_scaling_figure_names_the_csv_backend_and_reads_in_plain_numbers(monkeypatch, tmp_path):
    from bppsa.plots import scaling

    rows = [dict(seq_len=1000, batch=16, method=m, threads=p, iter=i, phase="backward", backend=be,
                 seconds=s / p ** 0.5 * (1 + 0.01 * i), device="cpu")
            for m, be, s in (("autograd", "", 3e-3), ("sequential", "", 4e-4), (scaling.BPPSA, "my-fast-path", 1e-3))
            for p in (1, 2) for i in range(8)]
    kept = []
    monkeypatch.setattr(scaling.plt, "close", kept.append)
    scaling.plot(pd.DataFrame(rows), tmp_path / "fig.png")
    (fig,) = kept
    top = fig.axes[0]
    (legend,) = fig.legends  # one legend for every panel, below them
    assert "BPPSA (backend my-fast-path)" in [t.get_text() for t in legend.get_texts()]
    assert top.get_legend() is None and "overtakes" in top.get_title()
    labels = [t.get_text() for t in top.get_yticklabels() if t.get_text()]
    assert labels and all(PLAIN.match(t) for t in labels), labels
    common.plt.close(fig)
