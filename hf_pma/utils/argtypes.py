"""``argparse`` types shared by the ``hf-pma`` sub-commands and the option dataclasses (one-line errors)."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "non_negative_int"]


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


def non_negative_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 0, with a one-line error otherwise."""
    return _int(text, 0, "a non-negative integer")
