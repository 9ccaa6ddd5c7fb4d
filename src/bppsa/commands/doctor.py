"""`bppsa doctor`, the first command to run on a new machine (see :mod:`bppsa.doctor`), and `bppsa device`, the
device slug and record every job of the workflow starts with (see :mod:`bppsa.device`)."""
from __future__ import annotations

import json


def _doctor(args) -> int:
    from ..doctor import diagnose, render

    rep = diagnose(args.device)
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0 if rep["ok"] else 1


def _device_cmd(args) -> int:
    from .. import device as _device

    dev = _device.resolve(args.device)
    if args.results_dir:
        _device.check_claim(args.results_dir, dev)
    if not args.json:
        print(_device.slug(dev))
        return 0
    info = _device.describe(dev)
    if args.device_slug:
        info["folder_slug"] = args.device_slug
    print(json.dumps(info, indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this machine: driver, torch/CUDA/cuDNN, CuPy/NVRTC, kernel compilation, "
        "a scan and verify per backend",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto, the GPU if torch sees one)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(func=_doctor)

    p = subparsers.add_parser("device", help="print the device slug (results/<device>/) or its full record")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print the environment record as JSON")
    p.add_argument("--device-slug", default=None, help="the results folder's name, recorded beside the detected one")
    p.add_argument("--results-dir", default=None,
                   help="check the hardware against the one recorded in this folder (see `bppsa bench --help`)")
    p.set_defaults(func=_device_cmd)
