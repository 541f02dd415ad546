"""``argparse`` types shared by the ``hf-pma`` sub-commands and the option dataclasses (one-line errors)."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "window_count", "non_negative_int", "positive_count", "parse_count"]


def _int(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from err
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An ``argparse`` type: a positive integer, with a one-line error otherwise."""
    return _int(text, 1, "a positive integer")


def window_count(text: str) -> int | str:
    """An ``argparse`` type: ``auto`` (the window chosen from the run's records) or a positive
    number of snapshots, with a one-line error otherwise."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _int(text, 1, "a positive integer")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a positive number of snapshots, got {text!r}") from None


def non_negative_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 0, with a one-line error otherwise."""
    return _int(text, 0, "a non-negative integer")


_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A positive count such as a number of tokens: ``40960``, ``40_960``, ``40,960``, ``40k``,
    ``2.5M``, ``1B``; ``ValueError`` otherwise."""
    raw = str(text).strip().replace("_", "").replace(",", "")
    scale = _COUNT_SUFFIXES.get(raw[-1:].lower(), 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = float(number) * scale if scale != 1 or "." in number else int(number)
    except ValueError:
        raise ValueError(f"expected a positive count like 40960, 40k or 2.5M, got {text!r}") from None
    if value < 1 or value != int(value):
        raise ValueError(f"expected a positive whole count like 40960, 40k or 2.5M, got {text!r}")
    return int(value)


def positive_count(text: str) -> int:
    """An ``argparse`` type: :func:`parse_count`, with a one-line error otherwise."""
    try:
        return parse_count(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
