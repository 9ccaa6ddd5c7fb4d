"""The figures and tables, from the measured CSVs of every device: `bppsa plot-rnn` (Fig 7, 8a-f), `bppsa
plot-gru` (Fig 9, 13), `bppsa fig10`, `bppsa table1` and `bppsa plot-scaling`.  Imports stay inside the
handlers: most of these jobs need neither torch nor the models."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("plot-rnn", help="render fig_7 and fig_8_a..f from results/*/rnn/*.csv")
    p.add_argument("--results", default="results")
    p.add_argument("--out-dir", default="results")
    p.set_defaults(func=_plot_rnn)

    p = sub.add_parser("plot-gru", help="Fig 9 (runtime breakdown) and Fig 13 (training curves) from the CSVs")
    p.add_argument("--results", default="results")
    p.add_argument("--out-dir", default="results")
    p.set_defaults(func=_plot_gru)

    p = sub.add_parser("fig10", help="Fig 10 from results/*/vgg11/flops.csv")
    p.add_argument("--results", default="results")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_fig10)

    p = sub.add_parser("table1", help="write results/table_1_last_column.txt from the measured CSVs")
    p.add_argument("--results", default="results")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_table1)

    p = sub.add_parser("plot-scaling", help="figure and extrapolated crossover from scaling CSVs")
    p.add_argument("csv", nargs="+")
    p.add_argument("--out", required=True, help="figure (.png/.pdf)")
    p.add_argument("--crossover", default=None, help="also write the fitted crossover table here (CSV)")
    p.set_defaults(func=_plot_scaling)


def _plot_rnn(args) -> int:
    from ..plots.rnn import plot_all

    for path in plot_all(args.results, args.out_dir):
        print(path)
    return 0


def _plot_gru(args) -> int:
    from ..plots.gru import plot_all

    for path in plot_all(args.results, args.out_dir):
        print(path, file=sys.stderr)
    return 0


def _fig10(args) -> int:
    from ..plots.fig10 import plot_fig10

    plot_fig10(args.results, args.out)
    return 0


def _table1(args) -> int:
    from ..plots.table1 import write_table1

    write_table1(args.results, args.out)
    return 0


def _plot_scaling(args) -> int:
    import pandas as pd

    from .. import io
    from ..plots.scaling import plot

    df = pd.concat([pd.read_csv(p) for p in args.csv], ignore_index=True)
    cross = plot(df, args.out)
    if args.crossover:
        io.write_csv(args.crossover, cross)
    print(cross.to_string(index=False), file=sys.stderr)
    return 0
