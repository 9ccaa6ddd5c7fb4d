"""Argument types shared by every command's parser (no torch: figure jobs import them too).

A size argument (``--seq-len``, ``--batch``, ``--hidden``, ...) is checked where it enters: argparse then
stops with ``argument --batch: must be a positive integer, got '0'``, naming the argument, before any work.
"""
from __future__ import annotations

import argparse

__all__ = ["nonnegative_int", "positive_int"]


def _int_at_least(minimum: int, name: str, what: str, doc: str):
    """An argparse ``type=`` taking integers >= ``minimum``; its error says "must be a <what> integer"."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text!r}")
        return value

    parse.__name__ = parse.__qualname__ = name
    parse.__doc__ = doc
    return parse


positive_int = _int_at_least(1, "positive_int", "positive",
                             "An integer >= 1 (the ``type=`` of every size argument); argparse names the argument.")
nonnegative_int = _int_at_least(0, "nonnegative_int", "non-negative",
                                "An integer >= 0 (a count where 0 means 'none' or 'all', as its help says).")
