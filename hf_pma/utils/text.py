"""One escape for text that came from outside: what a terminal, a log, an error line, a card or a
plot shows of a folder name, a record field, a Hub answer or a file's content.

A name or a record value may hold a newline (which forges a second line: a fake "merged OK"), a
terminal escape sequence (which moves the cursor, retitles the window or hides text) or a
bidirectional override (which shows ``evil.exe\u202ecod.py`` reversed). :func:`escape` writes every
character that is not printable (Unicode's "other" and "separator" categories but the ASCII space:
C0 and C1 controls, DEL, bidi and other format characters, line and paragraph separators, lone
surrogates from undecodable file names) the way Python's ``repr`` writes it (``\\n``, ``\\x1b``,
``\\u202e``), and leaves every other character as it is. :func:`shown` is a value as a one-line
error shows it: its ``repr`` (quoted, escaped the same way), cut to a length. Torch-free.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["escape", "is_printable", "shown"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped_char(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def is_printable(text: str) -> bool:
    """Whether ``text`` shows as it is: no control, format or separator character but the space."""
    return text.isprintable()


def escape(text: Any) -> str:
    """``text`` (a string, a path, or anything ``str`` converts) with every character that is not
    printable written as Python's ``repr`` writes it (``\\n``, ``\\x1b``, ``\\u202e``): one line,
    and nothing a terminal, a markdown renderer or a plot would act on. Printable text is returned
    unchanged."""
    text = os.fspath(text) if isinstance(text, os.PathLike) else text
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not isinstance(text, str):
        text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escaped_char(ch) for ch in text)


def shown(value: Any, limit: int = 200) -> str:
    """A value as a one-line error shows it: its ``repr`` (paths as their string's ``repr``),
    escaped (:func:`escape`: ``repr`` leaves no control character, but a ``str`` subclass or an
    object's own ``__repr__`` may), cut to ``limit`` characters with ``...``."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    text = escape(repr(value))
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."
