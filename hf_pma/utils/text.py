"""One escape for text that came from outside: what a terminal, a log, an error line, a card or a
plot shows of a folder name, a record field, a Hub answer or a file's content.

A name or a record value may hold a newline (which forges a second line: a fake "merged OK"), a
terminal escape sequence (which moves the cursor, retitles the window or hides text) or a
bidirectional override (which shows ``evil.exe\u202ecod.py`` reversed). :func:`escape` writes every
character that is not printable (Unicode's "other" and "separator" categories but the ASCII space:
C0 and C1 controls, DEL, bidi and other format characters, line and paragraph separators, lone
surrogates from undecodable file names) the way Python's ``repr`` writes it (``\\n``, ``\\x1b``,
``\\u202e``), and leaves every other character as it is. :func:`shown` is a value as a one-line
error shows it: its ``repr`` (quoted, escaped the same way), cut to a length.

What a command writes to stdout goes through :func:`write_line` (one line, escaped whole) or
:func:`write_lines` (a table whose cells are escaped already: each line escaped again), both
through :func:`write_out`, which survives a stdout that cannot encode a name or that nobody
reads any more (:func:`prepare_standard_streams` readies the streams at a command's start).
:func:`command_line` builds a command line for a person to paste (``hf-pma merge RUN ...``):
each argument shell-quoted, on one line. :func:`plot_text` is a label for matplotlib, which
reads ``$...$`` as math; :func:`markdown_text` a value in a model card's markdown, which would
otherwise read ``[text](url)`` as a link and ``<a ...>`` as HTML. Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = [
    "DiagnosticStream",
    "command_line",
    "drop_stdout",
    "escape",
    "flush_out",
    "is_printable",
    "markdown_text",
    "plot_text",
    "prepare_standard_streams",
    "shown",
    "write_line",
    "write_lines",
    "write_out",
]

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
    object's own ``__repr__`` may), cut to ``limit`` characters with ``...``. A value ``repr``
    cannot write (an integer of more than 4300 digits, a list nested past the recursion limit) is
    described instead."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    try:
        text = escape(repr(value))
    except ValueError:  # an integer past Python's 4300 digits for str
        digits = int(abs(value).bit_length() * 0.30103) + 1 if isinstance(value, int) else None
        text = f"<an integer of about {digits} digits>" if digits else f"<a {type(value).__name__}>"
    except RecursionError:
        text = f"<a {type(value).__name__} nested too deep to show>"
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def write_line(text: Any = "", stream: TextIO | None = None) -> None:
    """Write ``text`` as one line (:func:`escape`: a newline or an escape sequence in a name it
    holds shows as ``\\n``, ``\\x1b``, and cannot forge a line) and a newline, to ``stream``
    (default: stdout), through :func:`write_out`."""
    write_out(escape(text) + "\n", stream)


def write_out(text: str, stream: TextIO | None = None) -> None:
    """Write ``text`` to ``stream`` (default: stdout), the one way a command's output goes out.

    What the stream cannot encode (a non-ASCII folder name on ``PYTHONIOENCODING=ascii``) is
    written as ``\\xe9``; a stdout nobody reads any more (``| head -1`` done, a closed pipe) is
    dropped (:func:`drop_stdout`) and no longer written: the command's work is done either way,
    and its status is its own. A stdout closed at start (``>&-``, ``sys.stdout`` is ``None``)
    takes nothing."""
    stream = stream or sys.stdout
    if stream is None:
        return
    try:
        try:
            stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(stream, "encoding", None) or "ascii"
            stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        drop_stdout(stream)


def flush_out(stream: TextIO | None = None) -> None:
    """Flush ``stream`` (default: stdout); a reader that is gone drops it (:func:`drop_stdout`)."""
    stream = stream or sys.stdout
    if stream is None:
        return
    try:
        stream.flush()
    except (BrokenPipeError, ValueError):
        drop_stdout(stream)


def drop_stdout(stream: TextIO | None = None) -> None:
    """Point ``stream``'s file descriptor (default: stdout's) at ``/dev/null``: what it still holds
    and everything written later goes nowhere, and the flush at exit raises nothing."""
    stream = stream or sys.stdout
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):
        return
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def prepare_standard_streams() -> None:
    """Make the standard streams safe for a command, once at its start: a standard file
    descriptor that is closed (``>&-``, ``<&-``) is opened on ``/dev/null`` (else the first file the
    command opens would take its number, and a stray write to "stdout" would land in an output
    file); stdout writes what its encoding cannot (``PYTHONIOENCODING=ascii``) as ``\\xe9``."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="backslashreplace")
        except (ValueError, OSError):  # a stream that was replaced by something else
            pass
    if sys.stderr is not None and sys.stderr is sys.__stderr__:  # the process's own, not a caller's
        sys.stderr = DiagnosticStream(sys.stderr)


class DiagnosticStream:
    """stderr as a command's diagnostics go out (logs, progress bars, warnings, its error line):
    a stderr that cannot be written any more (its reader gone, ``2>&1 | head -1``; a full disk
    under ``2>job.err``; ``EIO``) is dropped (:func:`drop_stdout`: pointed at ``/dev/null``)
    instead of raising into the work, which goes on and keeps its own exit status. Everything
    else is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        """Write ``text``; nothing (and no error) once the stream cannot be written."""
        try:
            return self._stream.write(text)
        except (OSError, ValueError):  # ValueError: the stream was closed
            drop_stdout(self._stream)
            return len(text)

    def flush(self) -> None:
        """Flush; a stream that cannot be written is dropped."""
        try:
            self._stream.flush()
        except (OSError, ValueError):
            drop_stdout(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def write_lines(text: str, stream: TextIO | None = None) -> None:
    """Write a block of lines (a table) to ``stream`` (default: stdout), each line escaped.

    For text whose line breaks are the tool's own: a table whose cells are escaped already
    (:func:`hf_pma.utils.formatting.text_table`); what the lines hold is escaped once more. A
    value that may hold a newline must be escaped before it is put in such a block (or written
    with :func:`write_line`), else its newline would start a line of its own."""
    for line in text.split("\n"):
        write_line(line, stream)


def _shell_word(arg: str) -> str:
    """One argument quoted for a POSIX shell; one that holds a control character as bash's
    ANSI-C quoting ``$'...'`` (bash, zsh and ksh read it back exactly, and it stays on one line)."""
    if arg.isprintable():
        return shlex.quote(arg)
    body = "".join(
        "\\\\" if ch == "\\" else "\\'" if ch == "'" else ch if ch.isprintable() else _ansi_c(ch)
        for ch in arg
    )
    return f"$'{body}'"


def _ansi_c(ch: str) -> str:
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if 0xDC80 <= code <= 0xDCFF:  # a byte of an undecodable file name (os.fsdecode): the byte itself
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def command_line(args: Iterable[Any]) -> str:
    """A command line for a person to paste into a shell (``hf-pma merge 'my run/pma' --last 4``):
    each argument (a string, a path, a number) shell-quoted with :func:`shlex.quote`, one with a
    control character written ``$'...'`` so that the line stays one line; arguments joined by
    spaces. Every command line hf-pma prints or logs for pasting is built here."""
    return " ".join(_shell_word(os.fspath(a) if isinstance(a, os.PathLike) else str(a)) for a in args)


def plot_text(text: Any) -> str:
    """A label for matplotlib from a name or a record value: escaped (:func:`escape`) and with
    ``$`` written ``\\$``, since matplotlib reads ``$...$`` as mathtext (a hostile name could
    make it fail or draw something else)."""
    return escape(text).replace("$", "\\$")


# A backslash before ASCII punctuation escapes it in markdown: such a backslash of the value is
# doubled first, so that the value cannot undo the escapes added after it.
_MD_BACKSLASH = re.compile(r"\\(?=[!-/:-@\[-`{-~])")


def markdown_text(text: Any) -> str:
    """A name or a record value as a model card's markdown shows it: escaped (:func:`escape`), and
    with what markdown acts on written as text: ``]`` as ``\\]`` (no ``[text](url)`` link whose
    text hides where it leads, no link reference), ``<`` as ``&lt;`` (no HTML, no autolink with a
    disguised target), ``|`` as ``\\|`` (it would split a table cell); a backslash of the value
    before punctuation is doubled, so that it cannot undo these."""
    text = _MD_BACKSLASH.sub(r"\\\\", escape(text))
    return text.replace("]", "\\]").replace("<", "&lt;").replace("|", "\\|")
