"""Argument types shared by every command's parser (no torch: figure jobs import them too).

A size argument (``--seq-len``, ``--batch``, ``--hidden``, ...) is checked where it enters: argparse then
stops with ``argument --batch: must be a positive integer, got '0'``, naming the argument, before any work.
"""
from __future__ import annotations

import argparse

__all__ = ["nonnegative_int", "positive_int"]


def positive_int(text: str) -> int:
    """An integer >= 1 (the ``type=`` of every size argument); argparse names the argument in its error."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (a count where 0 means 'none' or 'all', as its help says)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value
