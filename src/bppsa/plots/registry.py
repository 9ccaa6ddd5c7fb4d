"""Every figure and table the workflow draws, declared once: :data:`FIGURES`.

A :class:`Figure` names its plotting function, what it reads in a device folder, what it writes, and for each
output `snakemake --report` shows, its caption and its place in the report.  Everything else is derived:

- the command line: ``bppsa plot NAME`` (:mod:`bppsa.commands.plots`), one choice per figure;
- the rules: ``NAME_plot`` in ``workflow/rules/figures.smk``, one per figure (its inputs, outputs, log and
  captions);
- the report's inputs and the workflow's final outputs: every output of every figure this configuration builds
  (``get_report_input`` in ``workflow/rules/common.smk``).

Which figures a configuration builds follows from what it measures, never from keys repeated here: a figure is
built where each file it reads matches one the configuration measures in its device folder
(``get_measurements`` in ``common.smk``), once per value of its wildcards found there.  The CPU scaling figure
is built for each model whose ``scaling.csv`` is measured, so on CPU machines with ``<model>.scaling.batches``.

Adding a figure: a function ``draw(results, inputs, outputs)`` in a module of :mod:`bppsa.plots` (it reads
``results/<device>/`` folders under ``results``, or where it draws one folder only, ``inputs``; it writes
exactly ``outputs``, in the declared order), a caption in ``workflow/report/``, and its :class:`Figure` below.
``tests/test_extension_points.py`` registers a dummy one and finds it in the CLI, the DAG and the report's inputs.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

DEVICE = "<device>"  # in an output's path: this run's device folder name (results/<device>/...)


@dataclass(frozen=True)
class Output:
    """One file a figure writes.  ``path``: relative to the workflow's folder, ``<device>`` for this run's device
    folder, and the figure's wildcards in braces.  ``caption`` (a file in ``workflow/report/``), ``category`` and
    ``subcategory`` place it in `snakemake --report`; an output without a caption is not in the report."""

    path: str
    caption: str | None = None
    category: str | None = None
    subcategory: str | None = None


@dataclass(frozen=True)
class Figure:
    """One ``bppsa plot NAME`` and its rule ``NAME_plot``.

    ``draw``: ``"module:function"``, imported only when the command runs (most figure jobs need no torch).
    ``reads``: patterns relative to a device folder (``*`` globs, ``{name}`` a wildcard).  ``overlay``: the figure
    draws every device folder under ``results/`` (their files are declared inputs too, so a folder added redraws
    it); otherwise it draws this run's folder alone, from the files passed to it."""

    name: str
    title: str
    draw: str
    reads: tuple[str, ...]
    outputs: tuple[Output, ...]
    overlay: bool = True

    @property
    def rule(self) -> str:
        return f"{self.name}_plot"

    @property
    def wildcards(self) -> tuple[str, ...]:
        """The wildcards of its outputs (each must appear in a read: the measured files give their values)."""
        return tuple(dict.fromkeys(w for o in self.outputs for w in re.findall(r"\{(\w+)\}", o.path)))

    @property
    def log(self) -> str:
        return "/".join(["logs", self.rule, *(f"{{{w}}}" for w in self.wildcards)]) + ".log"

    def paths(self, device: str, **wildcards: str) -> list[str]:
        """Its outputs' paths in the device folder ``device``, with the wildcards given filled in."""
        return [_fill(o.path.replace(DEVICE, device), wildcards) for o in self.outputs]

    def inputs(self, measured: list[str], device_dir: str, **wildcards: str) -> list[str]:
        """The files of ``measured`` (this run's, in ``device_dir``) it reads, for the wildcards' values given."""
        return [f for pattern in self.reads for f, _ in _matches(_fill(pattern, wildcards), measured, device_dir)]

    def instances(self, measured: list[str], device_dir: str) -> list[dict[str, str]]:
        """The wildcards' values for which this configuration builds it (``[{}]``: once; ``[]``: not at all)."""
        found = [wc for pattern in self.reads for _, wc in _matches(pattern, measured, device_dir)]
        candidates = [{w: wc[w] for w in self.wildcards} for wc in found if set(self.wildcards) <= set(wc)]
        built = []
        for wc in candidates if self.wildcards else [{}]:
            if wc not in built and all(_matches(_fill(p, wc), measured, device_dir) for p in self.reads):
                built.append(wc)
        return built

    def run(self, results: str, inputs: list[str], outputs: list[str]) -> None:
        module, _, function = self.draw.partition(":")
        getattr(importlib.import_module(module), function)(results, inputs, outputs)


def _fill(pattern: str, wildcards: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: wildcards.get(m[1], m[0]), pattern)


def _matches(pattern: str, files: list[str], device_dir: str) -> list[tuple[str, dict[str, str]]]:
    """(file, wildcards) of each of ``files`` that is ``device_dir/pattern``: ``*`` within one path component, as
    Path.glob does, and a ``{name}`` wildcard one component."""
    regex = re.escape(f"{device_dir}/{pattern}").replace(r"\*", "[^/]*")
    regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", regex)
    return [(f, m.groupdict()) for f in files if (m := re.fullmatch(regex, f))]


def _rnn_panel(letter: str) -> Output:
    against = "T" if letter in "abc" else "1/B"
    return Output(f"results/fig_8_{letter}.png", f"fig_8_{letter}.rst", "RNN (Sec 5.1)",
                  f"Fig 8{'a-c' if letter in 'abc' else 'd-f'}: against {against}")


FIGURES: dict[str, Figure] = {f.name: f for f in (
    Figure("rnn", "Fig 7 (training curves) and Fig 8a-f (latency, speedup, breakdown against T and 1/B)",
           "bppsa.plots.rnn:draw", ("rnn/speedups.csv", "rnn/latency.csv", "rnn/curve_*.csv"),
           (Output("results/fig_7.png", "fig_7.rst", "RNN (Sec 5.1)", "Fig 7: training curves"),
            *(_rnn_panel(letter) for letter in "abcdef"))),
    Figure("gru", "Fig 9 (runtime breakdown, and the numbers behind it) and Fig 13 (training curves)",
           "bppsa.plots.gru:draw", ("gru/speedups.csv", "gru/latency.csv", "gru/curve_*.csv"),
           (Output("results/fig_9.png", "fig_9.rst", "GRU (Sec 5.2)", "Fig 9: runtime breakdown"),
            Output("results/fig_13.png", "fig_13.rst", "GRU (Sec 5.2)", "Fig 13: training curves"),
            Output("results/fig_9_data.csv"))),
    Figure("vgg11", "Fig 10: FLOP per scan step against BP's operators (pruned VGG-11)",
           "bppsa.plots.fig10:draw", ("vgg11/flops.csv",),
           (Output("results/fig_10.png", "fig_10.rst", "Pruned VGG-11 (Sec 5.3)", "Fig 10: FLOP per step"),)),
    Figure("table1", "Table 1's last columns (sparsity, generation speedup) as text",
           "bppsa.plots.table1:draw", ("jacobians/table1*.csv",),
           (Output("results/table_1_last_column.txt", "table_1.rst", "Sparse Jacobians (Sec 3.4)", "Table 1"),)),
    Figure("cpu_scaling", "backward time against worker threads on this CPU, and the extrapolated crossover",
           "bppsa.plots.scaling:draw", ("{model}/scaling.csv",),
           (Output(f"results/{DEVICE}/fig_scaling_{{model}}.png", "fig_scaling.rst", "CPU benchmarks",
                   "Worker scaling: {model}"),
            Output(f"results/{DEVICE}/{{model}}/scaling_crossover.csv")),
           overlay=False),
    Figure("lenet5", "Fig 6: LeNet-5's training and test loss per iteration, autograd vs BPPSA, and their difference",
           "bppsa.plots.fig6:draw", ("lenet5/curve_*.csv",),
           (Output("results/fig_6.png", "fig_6.rst", "LeNet-5 (Sec 3.5)", "Fig 6: training curves"),)),
    Figure("workers", "BPPSA with the sequence split over p processes against the pipeline: time and memory per rank",
           "bppsa.plots.workers:draw", ("workers/time.csv", "workers/memory.csv"),
           (Output("results/fig_workers.png", "fig_workers.rst", "CPU benchmarks", "BPPSA across processes"),)),
    Figure("lbi", "Latent Bounded Interfaces: validation cross-entropy against the dense baseline, bytes per backward, "
           "backward time by scan and by pipeline across ranks",
           "bppsa.plots.lbi:draw", ("lbi/train_*.csv", "lbi/traffic.csv", "lbi/backward_time.csv"),
           (Output("results/fig_lbi.png", "fig_lbi.rst", "Latent Bounded Interfaces", "LBI: quality and traffic"),),
           overlay=False),
)}
