"""`bppsa device` and `bppsa make-bitstream`."""
from __future__ import annotations

import json

from .. import device as _device
from ..data import bitstream


def register(sub) -> None:
    p = sub.add_parser("device", help="print the device slug (results/<device>/) or its full record")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print the environment record as JSON")
    p.set_defaults(func=_device_cmd)

    p = sub.add_parser("make-bitstream", help="generate a bitstream dataset (Eq. 8)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_make_bitstream)


def _device_cmd(args) -> int:
    print(json.dumps(_device.describe(args.device), indent=2) if args.json else _device.slug(args.device))
    return 0


def _make_bitstream(args) -> int:
    bitstream.write(args.out, args.seq_len, args.samples, args.seed)
    return 0
