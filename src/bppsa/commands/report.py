"""`bppsa report`: results/report.md from every measured CSV."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="write results/report.md from the measured CSVs")
    p.add_argument("--results", default="results")
    p.add_argument("--out", default="results/report.md")
    p.add_argument("--claims-out", default=None, help="also write the claims table here (results/claims.md)")
    p.set_defaults(func=_report)


def _report(args) -> int:
    from .. import io
    from ..analysis.report import build

    io.write_text(args.out, build(args.results))
    if args.claims_out:
        from ..analysis import claims

        io.write_text(args.claims_out, claims.render(claims.collect(args.results)))
    return 0
