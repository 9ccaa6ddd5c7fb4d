"""`bppsa plot NAME`: a figure or table of :data:`bppsa.plots.registry.FIGURES` (its choices), drawn from the
measured CSVs.  The registry imports no plotting module: ``draw`` is imported when the command runs, so most of
these jobs start without torch."""
from __future__ import annotations

import argparse

from ..plots.registry import FIGURES


def register(sub) -> None:
    figures = "\n".join(f"{f.name}: {f.title} -> {', '.join(o.path for o in f.outputs)}" for f in FIGURES.values())
    p = sub.add_parser("plot", help="draw a figure or table of the paper from the measured CSVs",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=figures)
    p.add_argument("figure", choices=list(FIGURES), help="its declaration in bppsa.plots.registry")
    p.add_argument("--results", default="results",
                   help="the folder of the device folders it overlays (results/<device>/, results/reference/)")
    p.add_argument("--input", nargs="*", default=[], help="this device's files it reads (its rule's inputs)")
    p.add_argument("--out", nargs="+", required=True, help="the files it writes, in the declared order")
    p.set_defaults(func=_plot)


def _plot(args) -> int:
    fig = FIGURES[args.figure]
    if len(args.out) != len(fig.outputs):
        raise ValueError(f"{fig.name} writes {len(fig.outputs)} file(s) ({', '.join(o.path for o in fig.outputs)}),"
                         f" got --out {' '.join(args.out)}")
    fig.run(args.results, args.input, args.out)
    return 0
