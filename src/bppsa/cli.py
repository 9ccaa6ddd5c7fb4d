"""The `bppsa` command line: one sub-command per job the workflow runs.

Every module in :mod:`bppsa.commands` that defines ``register(subparsers)`` contributes its
commands; this file only collects them, so each experiment's commands live on their own.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Before torch loads libgomp: after each parallel region torch's OpenMP workers spin-wait for a new
# one (300,000 rounds by default), holding a core that the CPU fast path's own worker thread needs.
# On the 2-core reference machine that added ~3.5 ms to a 6 ms scan and ~1.5 ms to the compiled
# sequential backward, and changed neither autograd's forward nor its backward; a short spin removes
# it.  A value set by the user wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _keep_large_blocks() -> None:
    """Let glibc keep freed blocks of up to 32 MiB in the heap instead of returning them to the kernel.

    By default a block above ~128 KiB-32 MiB (a dynamic threshold) is mmap'd and unmapped on free, so a
    tensor of that size made every iteration is page-faulted and zeroed anew: at T = 1034, B = 64 the
    GRU's gate recomputation took 31 ms that way against 10 ms with blocks reused (2-core machine,
    measured).  Every method in a process gets the same allocator, so comparisons stay fair."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(M_TOP_PAD, 64 << 20)
    except (OSError, AttributeError):  # not glibc: its allocator's defaults
        pass


_keep_large_blocks()

from . import commands as _commands  # noqa: E402 - after the environment is set


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or where ``command`` is one of them, of its module's commands only
    (:data:`bppsa.commands.MODULES`): the other modules, and what they import, are not loaded."""
    parser = argparse.ArgumentParser(prog="bppsa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [m for m, cmds in _commands.MODULES.items() if command in cmds] or sorted(_commands.MODULES)
    for name in names:
        importlib.import_module(f"{_commands.__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        rc = args.func(args)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:  # clear one-line errors for users
        if os.environ.get("BPPSA_TRACEBACK"):  # the whole traceback too (scripts/gpu_check.sh sets it)
            import traceback

            traceback.print_exc()
        print(f"bppsa {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
