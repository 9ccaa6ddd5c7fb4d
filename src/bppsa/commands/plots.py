"""`bppsa plot-rnn`: Fig 7 and Fig 8a-f from the measured CSVs of every device."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("plot-rnn", help="render fig_7 and fig_8_a..f from results/*/rnn/*.csv")
    p.add_argument("--results", default="results")
    p.add_argument("--out-dir", default="results")
    p.set_defaults(func=_plot_rnn)


def _plot_rnn(args) -> int:
    from ..plots.rnn import plot_all

    for path in plot_all(args.results, args.out_dir):
        print(path)
    return 0
