"""The `bppsa` command line: one sub-command per job the workflow runs.

Every module in :mod:`bppsa.commands` that defines ``register(subparsers)`` contributes its
commands; this file only collects them, so each experiment's commands live on their own.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import process

process.keep_large_blocks()  # torch's OpenMP settings: on import of bppsa (bppsa.process)

from . import commands as _commands  # noqa: E402 - after the allocator is set


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Where ``command`` is a command, the parser of its module's commands only (:data:`bppsa.commands.MODULES`):
    the other modules, and what they import (torch), are not loaded.  Otherwise (``bppsa``, ``bppsa --help``, an
    unknown command) the list of every command with its help, read from the modules' source (:func:`commands`)."""
    parser = argparse.ArgumentParser(prog="bppsa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [m for m, cmds in _commands.MODULES.items() if command in cmds]
    for name in names:
        importlib.import_module(f"{_commands.__name__}.{name}").register(sub)
    if not names:
        for cmd, text in commands():
            sub.add_parser(cmd, help=text)
    return parser


def commands() -> list[tuple[str, str]]:
    """``(command, help)`` of every command, in the modules' order: each module's ``add_parser`` calls read from its
    source, so that listing them imports none (``tests/test_cli.py`` holds this to what ``register`` builds)."""
    import ast
    from pathlib import Path

    out = []
    for name in sorted(_commands.MODULES):
        tree = ast.parse(Path(_commands.__file__).with_name(f"{name}.py").read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_parser" and node.args and isinstance(node.args[0], ast.Constant)):
                text = next((k.value.value for k in node.keywords
                             if k.arg == "help" and isinstance(k.value, ast.Constant)), None)
                out.append((node.args[0].value, text))
    return out


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
