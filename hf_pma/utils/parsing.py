"""Parse and check what users give: dtypes and sizes (``"bf16"``, ``"5GB"``), and the one check of
"an integer, not a bool, in range" (:func:`is_int`, :func:`check_int`) and of "a number, not a
bool" (:func:`is_number`), with errors naming the argument. Torch-free.

The command line as users type it (:class:`CommandLineParser`, the parser of ``hf-pma`` and of the
scripts): no option is taken by an abbreviation of its name, an unknown option is refused with the
closest options named ("did you mean --learning_rate?"), and every refusal is one line.

Errors in library words: a function names its own parameter (``last must be a positive
integer, got 0``), through :func:`parameter_error`, which remembers the name; the ``hf-pma``
command shows that name as its flag (``--last must be ...``: :func:`hf_pma.cli.flag_words`).
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from hf_pma.utils.text import escape, shown

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT_DTYPE_NAMES",
    "CommandLineParser",
    "closest_options",
    "first_unknown_option",
    "folded",
    "hf_argument_parser",
    "parse_dataclasses",
    "check_int",
    "is_int",
    "parameter_error",
    "is_number",
    "parse_dtype",
    "parse_dtype_name",
    "parse_size",
]

# What users write -> the dtype's name in torch (``torch.<name>``).
FLOAT_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float64": "float64",
    "fp64": "float64",
}


def parse_dtype_name(dtype: Any, name: str = "dtype") -> str | None:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``"bfloat16"``, without importing torch;
    ``None`` stays ``None``. Only floating dtypes: weights are averaged or cast in them."""
    if dtype is None:
        return None
    key = str(dtype).lower().removeprefix("torch.")
    if key not in FLOAT_DTYPE_NAMES:
        if str(dtype).startswith("torch."):
            raise ValueError(f"{name} must be a floating-point dtype, got {dtype}")
        raise ValueError(f"unknown {name} {dtype!r}; choose float32, bfloat16 or float16")
    return FLOAT_DTYPE_NAMES[key]


def parse_dtype(dtype: str | torch.dtype | None, name: str = "dtype") -> torch.dtype | None:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; ``None`` stays ``None``.

    Only floating dtypes: weights are averaged or cast in them.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point dtype, got {dtype}")
        return dtype
    key = parse_dtype_name(dtype, name)
    return None if key is None else getattr(torch, key)


def parse_size(size: int | str, name: str = "size") -> int:
    """Bytes: ``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2 * 2**30, ``1000`` -> 1000."""
    if isinstance(size, bool):
        raise parameter_error(name, f"must be a size like '5GB' or a number of bytes, got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
        if not match:
            raise parameter_error(name, f"{shown(size, 40)} cannot be parsed: use bytes or a value like '5GB' or '500MiB'")
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(number * base ** "BKMGT".index(unit[0]))
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {size!r}")
    return value


def parameter_error(parameter: str, rest: str, kind: type[Exception] = ValueError) -> Exception:
    """The error for a bad value of the parameter ``parameter``: ``kind(f"{parameter} {rest}")``
    (``last must be a positive integer, got 0``), which remembers the name as its ``parameter``
    attribute (kept when the error is pickled to the other ranks), so that the ``hf-pma``
    command can show the name as its flag (``--last must be ...``)."""
    err = kind(f"{parameter} {rest}")
    err.parameter = parameter  # type: ignore[attr-defined]
    return err


def is_int(value: Any, minimum: int | None = None, maximum: int | None = None) -> bool:
    """Whether ``value`` is an ``int`` (``True`` and ``False`` are not: JSON and Python both let a
    bool pass as one) within ``minimum`` and ``maximum`` (each included; ``None``: no bound)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def is_number(value: Any, finite: bool = False) -> bool:
    """Whether ``value`` is an ``int`` or a ``float`` (not a bool); with ``finite``, not NaN or an
    infinity either."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


def _range_words(minimum: int | None, maximum: int | None) -> str:
    if maximum is None:
        return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
    return f"an integer <= {maximum}" if minimum is None else f"an integer from {minimum} to {maximum}"


def check_int(
    value: Any,
    name: str,
    minimum: int | None = 1,
    maximum: int | None = None,
    allow_none: bool = False,
) -> Any:
    """``value`` when it is an integer (not a bool) from ``minimum`` to ``maximum`` (or ``None``
    with ``allow_none``); else a one-line ``ValueError`` naming ``name``: ``"last must be a
    positive integer, got 0"``. The default range is the positive integers."""
    if (value is None and allow_none) or is_int(value, minimum, maximum):
        return value
    either = " or None" if allow_none else ""
    raise parameter_error(name, f"must be {_range_words(minimum, maximum)}{either}, got {shown(value, 60)}")


# A refusal on the command line is one line of at most about this many characters.
ERROR_LINE_CHARS = 200


def folded(items: Iterable[Any], shown_items: int = 3, sep: str = ", ") -> str:
    """``items`` as a short phrase of one line: ``a, b, c and 12 more`` (each escaped), a long
    list never written out whole."""
    items = [escape(item) for item in items]
    if len(items) <= shown_items + 1:
        return sep.join(items)
    return f"{sep.join(items[:shown_items])} and {len(items) - shown_items} more"


def _spelling(option: str) -> str:
    """An option as compared: its name without a value (``--a=1``), ``_`` and ``-`` alike, any case."""
    return option.split("=", 1)[0].replace("_", "-").lower()


def _visible_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option string of ``parser`` that ``--help`` shows -> the option's name as the help
    writes it first (``--eval_file`` and ``--eval-file`` -> ``--eval-file`` when that comes first)."""
    names: dict[str, str] = {}
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        for option in action.option_strings:
            names[option] = longs[0] if longs else option
    return names


def closest_options(given: str, parser: argparse.ArgumentParser, n: int = 2) -> list[str]:
    """The options of ``parser`` that ``given`` (an unknown option) most likely means: those it
    abbreviates, else the closest spellings (``--learnig_rate`` -> ``--learning_rate``,
    ``--eval_file`` -> ``--eval-file``), at most ``n``, a second one only when about as close as
    the first; hidden options are never suggested."""
    spelled: dict[str, str] = {}
    for option, name in _visible_options(parser).items():
        spelled.setdefault(_spelling(option), name)
    key = _spelling(given)
    if key in spelled:  # another spelling of a known option (``--Eval_File``)
        return [spelled[key]]
    prefixed = [name for s, name in spelled.items() if s.startswith(key) and len(key.lstrip("-")) > 1]
    if prefixed:
        return list(dict.fromkeys(prefixed))[:n]
    scores = sorted(((_likeness(key, s), s) for s in spelled), reverse=True)
    close = [s for score, s in scores if score >= max(0.6, scores[0][0] - 0.05)] if scores else []
    return list(dict.fromkeys(spelled[s] for s in close))[:n]


def _likeness(a: str, b: str) -> float:
    """How alike two option names are, without their dashes (0 to 1, as ``difflib`` rates it)."""
    return difflib.SequenceMatcher(None, a.lstrip("-"), b.lstrip("-")).ratio()


def first_unknown_option(parser: argparse.ArgumentParser, args: Sequence[str]) -> tuple[str, argparse.ArgumentParser] | None:
    """The first ``--option`` of ``args`` that ``parser`` (or the sub-command it names) does not
    know, with that (sub-)parser; ``None`` when all are known. Checked before argparse's own
    checks, so that a typo is named before a missing argument is."""
    current = parser
    for arg in args:
        if arg == "--":
            return None
        subparsers = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if subparsers and arg in subparsers[0].choices:
            current = subparsers[0].choices[arg]
        elif arg.startswith("--") and arg.split("=", 1)[0] not in current._option_string_actions:
            return arg.split("=", 1)[0], current
    return None


def _unknown_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """What ``parser`` says of the arguments it did not recognise: the first unknown option and the
    options it most likely means, or the stray values."""
    before_end = extras[: list(extras).index("--")] if "--" in extras else extras  # after it: values
    options = [a for a in before_end if a.startswith("-") and len(a) > 1 and not _is_number(a)]
    if not options:
        return f"unexpected argument(s) {folded(extras)}; see {escape(parser.prog)} --help"
    given = options[0].split("=", 1)[0]
    matches = closest_options(given, parser)
    more = f" (and {len(options) - 1} more unknown)" if len(options) > 1 else ""
    abbreviated = matches and all(_spelling(m).startswith(_spelling(given)) for m in matches)
    why = " (options are not abbreviated)" if abbreviated and _spelling(given) not in map(_spelling, matches) else ""
    if not matches:
        return f"unknown option {escape(given)}{more}; see {escape(parser.prog)} --help"
    return f"unknown option {escape(given)}{why}{more}; did you mean {' or '.join(matches)}?"


def _is_number(text: str) -> bool:
    """Whether ``text`` is a negative number (a value, not an option)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$")


def _with_suggestion(message: str, prog: str) -> str:
    """An argparse error in one short line: an invalid choice (``hf-pma mrege``) with the closest
    choice named, or its list of choices folded."""
    match = _INVALID_CHOICE.search(message)
    if not match:
        return message
    choices = [c.strip().strip("'") for c in match.group("choices").split(",")]
    close = difflib.get_close_matches(match.group("given"), choices, n=1, cutoff=0.5)
    head = message[: match.start()] + f"invalid choice {shown(match.group('given'), 60)}"
    if close:
        return f"{head}; did you mean {close[0]}?"
    listed = folded(choices, 6)
    return f"{head}; choose from {listed}" + (f" ({prog} --help lists them)" if len(choices) > 7 else "")


class CommandLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` as a command line should be: options by their whole name only
    (``allow_abbrev=False``: ``--max_step`` is not ``--max_steps``), an unknown option refused with
    the closest options named and the sub-command that was meant (``hf-pma compare: error: unknown
    option --eval_file; did you mean --eval-file?``), and every refusal one escaped line on stderr
    with exit code 2, before anything runs. Sub-parsers are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False  # a prefix would silently become another option
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As ``argparse``'s, with unknown arguments refused by :meth:`refuse_unknown`, an unknown
        option before any other error."""
        args = sys.argv[1:] if args is None else list(args)
        self.refuse_unknown_options(args)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.refuse_unknown(extras, parsed)
        return parsed

    def refuse_unknown(self, extras: Sequence[str], namespace: Any = None) -> NoReturn:
        """Exit 2 with one line naming the first unknown option of ``extras`` and the options it
        most likely means, in the words of the sub-command given in ``namespace``."""
        parser = self._chosen(namespace)
        parser.error(_unknown_message(extras, parser))

    def refuse_unknown_options(self, args: Sequence[str]) -> None:
        """Exit 2 with one line when ``args`` hold an ``--option`` unknown where it stands
        (:func:`first_unknown_option`); return otherwise."""
        unknown = first_unknown_option(self, args)
        if unknown is not None:
            option, parser = unknown
            parser.error(_unknown_message([option], parser))

    def _chosen(self, namespace: Any) -> argparse.ArgumentParser:
        """The (sub-)parser that parsed the last arguments: this one, or the chosen sub-command's."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(namespace, action.dest, None) or "")
                if isinstance(sub, CommandLineParser):
                    return sub._chosen(namespace)
        return self

    def error(self, message: str) -> NoReturn:
        """An argparse error as :meth:`refuse` writes it, with where to look when it names no fix."""
        message = _with_suggestion(message, self.prog)
        hint = f"; see {self.prog} --help"
        fits = len(self.prog) + len(message) + len(hint) + 9 <= ERROR_LINE_CHARS
        if "did you mean" not in message and "--help" not in message and fits:
            message += hint
        self.refuse(message)

    def refuse(self, message: str) -> NoReturn:
        """One line on stderr, ``PROG: error: MESSAGE`` (escaped), and exit code 2: a bad command
        line (``message`` saying what to do), before anything runs."""
        if sys.stderr is not None:
            sys.stderr.write(escape(f"{self.prog}: error: {message}") + "\n")
            sys.stderr.flush()
        raise SystemExit(2)


def hf_argument_parser(dataclass_types: Any, **kwargs: Any) -> Any:
    """A ``transformers.HfArgumentParser`` of ``dataclass_types`` that is a :class:`CommandLineParser`
    too (no abbreviations, the closest options named, one-line refusals): the parser of the
    scripts; read it with :func:`parse_dataclasses`."""
    from transformers import HfArgumentParser

    class ScriptArgumentParser(CommandLineParser, HfArgumentParser):
        """``HfArgumentParser`` with the command line of :class:`CommandLineParser`."""

    return ScriptArgumentParser(dataclass_types, **kwargs)


def parse_dataclasses(parser: Any, argv: Sequence[str]) -> tuple[Any, ...]:
    """``parser.parse_args_into_dataclasses(argv)`` (an ``HfArgumentParser``), with an unknown
    option refused first in one line naming the closest options (exit code 2), instead of
    transformers' ``Some specified arguments are not used by the HfArgumentParser`` error."""
    if isinstance(parser, CommandLineParser):
        parser.refuse_unknown_options(argv)
    namespace, extras = parser.parse_known_args(list(argv))
    if extras:
        if isinstance(parser, CommandLineParser):
            parser.refuse_unknown(extras, namespace)
        parser.error(f"unknown argument(s) {folded(extras)}")
    return tuple(parser.parse_args_into_dataclasses(list(argv)))
