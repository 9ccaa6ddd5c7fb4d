"""What a reader sees: log axes labelled in plain numbers, Fig 9's labels clear of the bars and of each other,
and every legend naming the backend the CSVs say measured each line."""
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bppsa.analysis import speedups
from bppsa.plots import common, gru, registry, rnn

# one worker takes the whole file (--dist loadgroup): the figures drawn once per reference setting (drawn)
pytestmark = pytest.mark.xdist_group("test_figures")
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
    ax = f_sp.axes[0]  # the first panel's backward
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(PLAIN.match(t) for t in labels), labels
    assert "1×" in labels and not [t for t in ax.yaxis.get_ticklabels(minor=True) if t.get_text()]
    assert ax.get_title().endswith("BPPSA (my-fast-path) vs my-autograd · B = 16")  # the backends: in the title
    (legend,) = f_sp.legends  # the variants and line styles: one legend under the panels
    assert [t.get_text() for t in legend.get_texts()][:1] == ["BPPSA fused"]
    lat_ax = f_lat.axes[0]
    assert all(PLAIN.match(t.get_text()) for t in lat_ax.get_yticklabels() if t.get_text())
    assert "BPPSA (my-fast-path) vs my-autograd" in lat_ax.get_title()
    assert [t.get_text() for t in f_lat.legends[0].get_texts()] == ["baseline", "BPPSA fused"]
    assert "BPPSA (my-fast-path) vs my-autograd" in f_bd.axes[0].get_title()
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
    fig.tight_layout(rect=fig._bppsa_rect)  # what save() does before writing
    fig.canvas.draw()
    ax = fig.axes[0]
    labels, bars = _boxes(fig, ax)
    assert len(labels) == 9
    frame = ax.get_window_extent(fig.canvas.get_renderer())
    for i, a in enumerate(labels):
        assert frame.y0 <= a.y0 and a.y1 <= frame.y1 + 0.5, "a label leaves the axes"
        assert not any(a.overlaps(b) for b in bars), "a label covers a bar"
        assert not any(a.overlaps(b) for b in labels[i + 1:]), "two labels overlap"
    assert ax.get_title().endswith("BPPSA (my-fast-path) vs my-autograd")
    common.plt.close(fig)


def _curve(method, dtype, losses, backend, forward="torch", kernel=None, step_s=2.0):
    return pd.DataFrame(dict(epoch=np.arange(1, len(losses) + 1), wall_clock_s=np.arange(1, len(losses) + 1) * step_s,
                             loss=losses, accuracy=0.3, steps=64, profile="test", device="cpu", model="rnn",
                             method=method, backend=backend, layout="fused" if method == "bppsa" else "",
                             forward=forward, forward_kernel=kernel or ("compiled" if forward == "auto" else "torch"),
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


def test_fig_7_and_13_draw_the_compiled_forward_as_a_variant_of_its_own(monkeypatch):
    """BPPSA with the compiled forward is its own line (its own wall-clock: faster steps) beside BPPSA with torch's
    forward and the baseline, in the loss, accuracy and difference panels; a run that found no compiled forward says
    so in its legend entry."""
    base = np.array([2.3, 2.0, 1.9, 1.8])
    curves = pd.concat([_curve("baseline", "float32", base, "autograd"),
                        _curve("bppsa", "float32", base * (1 + 1e-6), "cpu"),
                        _curve("bppsa", "float32", base * (1 + 2e-6), "cpu", forward="auto", step_s=0.5)])
    figs = _capture(monkeypatch, rnn)
    rnn.fig_7(curves.assign(device_label="cpu"), "x.png")
    (fig,) = figs
    loss_ax, acc_ax, diff_ax = fig.axes
    for ax in (loss_ax, acc_ax):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert len(lines) == 3
        (compiled,) = [lab for lab in lines if "compiled forward" in lab]
        assert "backend cpu" in compiled
        assert max(lines[compiled].get_xdata()) == pytest.approx(2.0)  # its own wall-clock, from its own CSV
    diff = [t.get_text() for t in diff_ax.get_legend().get_texts()]
    assert len(diff) == 2 and sum("compiled fwd" in t for t in diff) == 1
    common.plt.close(fig)

    gru_curves = curves.assign(model="gru", seq_len=1034, device_label="cpu")
    gru_curves.loc[gru_curves["forward"] == "auto", "forward_kernel"] = "torch"  # no compiled forward on that host
    figs = _capture(monkeypatch, gru)
    gru.fig_13(gru_curves, "x.png")
    (fig,) = figs
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(labels) == 3 and any("compiled forward" in t and "(no compiled forward there: torch's)" in t
                                    for t in labels)
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


# -- every figure at a glance, with the committed H200 reference beside this machine's results ---------------------
ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "results" / "reference" / "nvidia-h200"
CPU_BACKENDS = {"baseline": "autograd", "bppsa-fused": "cpu", "bppsa-paper": "cpu"}


def _cpu_results(results):
    """results/cpu/{rnn,gru}/ as the default profile writes them on a CPU: the T sweep at B = 16, the B sweep at
    T = 1000, the three MFCC sets at three batch sizes, and the training curves of Fig 7 and Fig 13."""
    rnn_rows = []
    for T, B in [(T, 16) for T in (10, 30, 100, 300, 1000)] + [(1000, B) for B in (2, 4, 8, 32, 64)]:
        s = (T / 100) ** 0.5 * (16 / B) ** 0.3
        base = {"forward": 2e-6 * T, "backward": 5e-6 * T, "optimizer": 1e-5}
        bp = {"forward": 2e-6 * T, "jacobian": 1e-5, "backward": 5e-6 * T / s, "optimizer": 1e-5}
        paper = {**bp, "jacobian": 1e-6 * T, "backward": 8e-6 * T / s}
        rnn_rows += _bench("rnn", T, B, {"baseline": base, "bppsa-fused": bp, "bppsa-paper": paper}, CPU_BACKENDS)
    gru_rows = []
    for T in (259, 517, 1034):
        for B in (16, 32, 64):
            base = {"forward": 0.3e-3 * T / 259, "backward": 1.0e-3 * T / 259, "optimizer": 0.05e-3}
            s = 1.5 * (T / 259) ** 0.5
            bp = {"forward": base["forward"], "jacobian": 1e-5, "backward": base["backward"] / s, "optimizer": 0.05e-3}
            gru_rows += _bench("gru", T, B, {"baseline": base, "bppsa-fused": bp}, CPU_BACKENDS,
                               data="synthetic IRMAS stand-in")
    for model, rows in (("rnn", rnn_rows), ("gru", gru_rows)):
        folder = results / "cpu" / model
        folder.mkdir(parents=True)
        bench = pd.DataFrame(rows)
        speedups.latency(bench).to_csv(folder / "latency.csv", index=False)
        speedups.speedups(bench).to_csv(folder / "speedups.csv", index=False)
    base = np.array([2.3, 2.1, 2.0, 1.9, 1.85, 1.8, 1.78, 1.75])
    for method, dtype in (("baseline", "float32"), ("bppsa", "float32"), ("baseline", "float64"), ("bppsa", "float64")):
        c = _curve(method, dtype, base, CPU_BACKENDS["baseline" if method == "baseline" else "bppsa-fused"])
        name = ("baseline" if method == "baseline" else "bppsa-fused") + ("_float64" if dtype == "float64" else "")
        c.to_csv(results / "cpu" / "rnn" / f"curve_{name}.csv", index=False)
    # the default profile's compiled-forward curves: Fig 7's in float32, Fig 13's on set L
    _curve("bppsa", "float32", base * (1 + 1e-6), "cpu", forward="auto", step_s=0.4).to_csv(
        results / "cpu" / "rnn" / "curve_bppsa-fused-compiled.csv", index=False)
    for method, backend in (("baseline", "autograd"), ("bppsa", "cpu")):
        c = pd.concat(_curve(method, "float32", base[:3], backend).assign(seq_len=T, batch=16, model="gru")
                      for T in (259, 517, 1034))
        c.to_csv(results / "cpu" / "gru" / f"curve_{method}.csv", index=False)
    _curve("bppsa", "float32", base[:3], "cpu", forward="auto", step_s=0.6).assign(seq_len=1034, model="gru").to_csv(
        results / "cpu" / "gru" / "curve_l_bppsa-fused-compiled.csv", index=False)


@pytest.fixture(scope="module", params=[True, False], ids=["with-h200-reference", "cpu-alone"])
def drawn(request, tmp_path_factory):
    """Every figure of `bppsa plot rnn` and `plot gru`, drawn and saved as the workflow does, kept open to be
    measured."""
    results = tmp_path_factory.mktemp("figs") / "results"
    _cpu_results(results)
    if request.param:
        (results / "reference").mkdir()
        (results / "reference" / "nvidia-h200").symlink_to(H200)
    kept = []
    mp = pytest.MonkeyPatch()
    mp.setattr(common.plt, "close", kept.append)
    mp.setattr(common.plt.Figure, "savefig", lambda fig, path, **kw: Path(path).write_bytes(b""))  # laid out, unsaved
    try:
        outs = []
        for figure in (registry.FIGURES["rnn"], registry.FIGURES["gru"]):
            paths = [results.parent / Path(p).name for p in figure.paths("cpu")]
            figure.run(results, [], paths)
            outs += paths
    finally:
        mp.undo()
    pngs = [p.name for p in outs if p.suffix == ".png"]
    assert len(kept) == len(pngs)
    yield request.param, dict(zip(pngs, kept))
    for fig in kept:
        common.plt.close(fig)


def _shown(axis):
    """The tick labels an axis draws: inside its view, with text."""
    lo, hi = sorted(axis.get_view_interval())
    slack = (hi - lo) * 1e-9
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    return [t.label1 for t in ticks if lo - slack <= t.get_loc() <= hi + slack
            and t.label1.get_visible() and t.label1.get_text()]


def _text_boxes(fig):
    """(name, bounding box in pixels) of every text a reader sees; a legend counts as one box."""
    r = fig.canvas.get_renderer()
    items = []
    if fig._suptitle is not None and fig._suptitle.get_text():
        items.append(("suptitle", fig._suptitle))
    items += [(f"figure text {t.get_text()[:30]!r}", t) for t in fig.texts if t.get_text() and t is not fig._suptitle]
    items += [(f"figure legend {i}", leg) for i, leg in enumerate(fig.legends)]
    for i, ax in enumerate(fig.axes):
        for what, t in (("title", ax.title), ("left title", ax._left_title), ("right title", ax._right_title),
                        ("xlabel", ax.xaxis.label), ("ylabel", ax.yaxis.label)):
            if t.get_visible() and t.get_text():
                items.append((f"axes {i} {what} {t.get_text()[:30]!r}", t))
        items += [(f"axes {i} text {t.get_text()[:20]!r}", t) for t in ax.texts if t.get_text()]
        items += [(f"axes {i} tick {t.get_text()!r}", t) for t in _shown(ax.xaxis) + _shown(ax.yaxis)]
        if ax.get_legend() is not None:
            items.append((f"axes {i} legend", ax.get_legend()))
    return [(name, a.get_window_extent(r)) for name, a in items]


FIGURES = {  # name: (panels on a CPU alone, panels with the H200 reference: CPU vs autograd, H200 vs cuDNN and vs
    # cuDNN per-step); Fig 8b/e have two rows per panel
    **{f"fig_8_{p}.png": (1, 3) for p in "acdf"}, "fig_8_b.png": (2, 6), "fig_8_e.png": (2, 6),
    "fig_9.png": (1, 3), "fig_7.png": (3, 3), "fig_13.png": (3, 3),
}


def _assert_reads_at_a_glance(fig, name: str) -> None:
    """At most 6 legend entries per legend, titles of at most two lines, the profile and device in a footer or
    title, and no text over another or outside the figure."""
    fig.canvas.draw()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + fig.legends
    assert legends and all(len(leg.get_texts()) <= 6 for leg in legends), (name, [len(x.get_texts()) for x in legends])
    assert fig._suptitle is None or fig._suptitle.get_text().count("\n") <= 1, name
    assert all(ax.get_title().count("\n") <= 1 for ax in fig.axes), name
    everything = " ".join(t.get_text() for t in fig.texts) + (fig._suptitle.get_text() if fig._suptitle else "")
    assert "profile" in everything and "cpu" in everything, name
    boxes = _text_boxes(fig)
    page = fig.bbox.padded(1)
    outside = [n for n, b in boxes if not (page.x0 <= b.x0 and b.x1 <= page.x1 and page.y0 <= b.y0 and b.y1 <= page.y1)]
    assert not outside, (name, outside)
    clashes = [(n, m) for i, (n, a) in enumerate(boxes) for m, b in boxes[i + 1:] if a.overlaps(b)]
    assert not clashes, (name, clashes)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_reads_at_a_glance(drawn, name):
    """Per figure: the axes the data call for, and what :func:`_assert_reads_at_a_glance` holds."""
    with_reference, figs = drawn
    fig = figs[name]
    fig.canvas.draw()
    assert len(fig.axes) == FIGURES[name][with_reference], name
    if with_reference and name.startswith(("fig_8", "fig_9")):
        titles = " / ".join(ax.get_title() for ax in fig.axes)
        assert "nvidia-h200 (reference)" in titles and "cuDNN per-step" in titles and "autograd" in titles
    if name in ("fig_8_d.png", "fig_8_e.png", "fig_8_f.png"):  # against 1/B: a CPU panel's fraction is of the CPU
        labels = {ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()}
        gpu = {"fraction of GPU per sample 1/B"} if with_reference else set()
        want = {"fraction of the CPU per sample 1/B"} | gpu
        assert labels == want, (name, labels)
    _assert_reads_at_a_glance(fig, name)


def _vgg_flops(folder: Path) -> None:
    """vgg11/flops.csv as `bppsa vgg11-flops` writes it: per network and sample, the scan's steps (mv and mm, some
    on the critical path) and BP's operators, with their FLOP and dense sizes."""
    rng = np.random.default_rng(0)
    rows = []
    for net in ("pruned", "dense"):
        for sample in range(2):
            for i in range(40):
                phase, kind = ("baseline", "mm") if i % 4 == 0 else ("up", "mv" if i % 3 else "mm")
                size = float(10 ** rng.uniform(3, 9))
                rows.append(dict(network=net, sample=sample, phase=phase, kind=kind, critical=bool(i % 5 == 1),
                                 dense_size=size, flop=size * (0.1 if net == "pruned" else 0.5), prune=0.9,
                                 scheme="class-uniform", width=0.125, L_m=3, profile="default",
                                 data="synthetic CIFAR-10 stand-in", models="vgg11 trained here", device="cpu"))
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "flops.csv", index=False)


def _scaling(folder: Path, model: str) -> None:
    """<model>/scaling.csv as `bppsa scaling` writes it: three methods at 1 and 2 threads, two shapes."""
    from bppsa.plots import scaling

    rows = [dict(seq_len=T, batch=16, method=m, threads=p, iter=i, phase="backward", backend=be, model=model,
                 seconds=s * T / 1000 / p ** 0.7 * (1 + 0.01 * i), device="cpu", profile="default")
            for T in (1000, 10000)
            for m, be, s in (("autograd", "", 3e-2), ("sequential", "", 4e-3), (scaling.BPPSA, "cpu", 2e-3))
            for p in (1, 2) for i in range(8)]
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / "scaling.csv", index=False)


@pytest.mark.parametrize("with_reference", [True, False], ids=["with-h200-reference", "cpu-alone"])
def test_fig_10_and_the_scaling_figures_read_at_a_glance(with_reference, tmp_path, monkeypatch):
    """The default workflow's other figures (Fig 10, fig_scaling_{rnn,gru}), drawn through the registry."""
    results = tmp_path / "results"
    _vgg_flops(results / "cpu" / "vgg11")
    for model in ("rnn", "gru"):
        _scaling(results / "cpu" / model, model)
    if with_reference:
        (results / "reference").mkdir()
        (results / "reference" / "nvidia-h200").symlink_to(H200)
    kept = []
    monkeypatch.setattr(common.plt, "close", kept.append)
    monkeypatch.setattr(common.plt.Figure, "savefig", lambda fig, path, **kw: Path(path).write_bytes(b""))
    drawn = []
    fig10 = registry.FIGURES["vgg11"]
    fig10.run(results, [], [tmp_path / Path(p).name for p in fig10.paths("cpu")])
    drawn.append(("fig_10.png", kept[-1]))
    scaling = registry.FIGURES["cpu_scaling"]
    for model in ("rnn", "gru"):
        csv = results / "cpu" / model / "scaling.csv"
        outs = [tmp_path / Path(p).name for p in scaling.paths("cpu", model=model)]
        scaling.run(results, [csv], outs)
        drawn.append((f"fig_scaling_{model}.png", kept[-1]))
    assert [n for n, _ in drawn] == ["fig_10.png", "fig_scaling_rnn.png", "fig_scaling_gru.png"]
    for name, fig in drawn:
        _assert_reads_at_a_glance(fig, name)
        common.plt.close(fig)


def test_fig_9_labels_a_configuration_timed_too_few_rounds_for_an_interval(monkeypatch):
    """Two rounds give a median but no interval (the .test profile's GRU): the label still stands above the bars."""
    base = {"forward": 0.3e-3, "backward": 1.0e-3, "optimizer": 0.05e-3}
    bp = {"forward": 0.3e-3, "jacobian": 1e-5, "backward": 0.2e-3, "optimizer": 0.05e-3}
    bench = pd.DataFrame(_bench("gru", 259, 4, {"baseline": base, "bppsa-fused": bp}, BACKENDS, iters=2))
    lat, sp = speedups.latency(bench).assign(device_label="cpu"), speedups.speedups(bench).assign(device_label="cpu")
    figs = _capture(monkeypatch, gru)
    gru.fig_9(lat, sp, "x.png")
    (fig,) = figs
    fig.canvas.draw()
    ax = fig.axes[0]
    (label,) = ax.texts
    assert "[no interval]" in label.get_text() and np.isfinite(label.xy[1]) and label.xy[1] >= 1.0
    box, frame = label.get_window_extent(), ax.get_window_extent()
    assert frame.y0 <= box.y0 and box.y1 <= frame.y1 + 0.5
    common.plt.close(fig)


def test_fig_8c_draws_a_baseline_timed_at_fewer_points_over_those_alone(monkeypatch):
    """cuDNN's per-step baseline left out at T = 30000 (too slow to time there): its panel draws T = 100 and 1000."""
    lat = pd.read_csv(H200 / "rnn" / "latency.csv").assign(device_label="nvidia-h200 (reference)")
    lat = lat[~((lat["variant"] == "baseline-packed") & (lat["seq_len"] == 30000))]
    figs = _capture(monkeypatch, rnn)
    rnn.fig_breakdown(lat, "seq_len", "x.png")
    (fig,) = figs
    cudnn, per_step = fig.axes
    assert [t.get_text() for t in cudnn.get_xticklabels()] == ["100", "1000", "30000"]
    assert [t.get_text() for t in per_step.get_xticklabels()] == ["100", "1000"]
    common.plt.close(fig)
