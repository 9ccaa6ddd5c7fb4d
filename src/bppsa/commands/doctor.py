"""`bppsa doctor`: the first command to run on a new machine (see :mod:`bppsa.doctor`)."""
from __future__ import annotations

import json


def _doctor(args) -> int:
    from ..doctor import diagnose, render

    rep = diagnose(args.device)
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0 if rep["ok"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this machine: driver, torch/CUDA/cuDNN, CuPy/NVRTC, kernel compilation, "
        "a scan and verify per backend",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto, the GPU if torch sees one)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(func=_doctor)
