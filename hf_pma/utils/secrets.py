"""Keep access tokens out of everything hf-pma writes: one redaction, by name and by value.

Every command line or argument record the library writes (the reproducing command of
``pma_training.json``, cards, JSON records, hf-pma's log lines) goes through :func:`redact`
(text) or :func:`redact_obj` (JSON-like values). Two rules, both always applied:

* **by name**: the value given to anything named like a secret is replaced by ``***``: flags
  (``--hub_token X``, ``--hub-token=X``, ``--token X``, ``--wandb_api_key X``, any
  ``--*_token`` / ``--*-token``), variables (``HF_TOKEN=X``, any ``*_TOKEN=`` / ``*_API_KEY=``),
  keys (``"hub_token": "X"``, ``hub_token=X``). Tokenizer words (``--pad_token``,
  ``--eos_token``, ...) and counts (``--max_tokens``, ``--interval_tokens``) are not secrets
  and are kept.
* **by value**: the tokens in use (:func:`tokens_in_use`: ``HF_TOKEN``,
  ``HUGGING_FACE_HUB_TOKEN``, the cached login of ``huggingface_hub.get_token()``, and any
  value given by the caller) are replaced wherever they appear, whatever their shape; so are
  strings shaped like Hugging Face tokens (``hf_...``, ``api_org_...``).
* **in URLs**: the user information of a URL (``scheme://user:password@host``, as in an
  ``HF_ENDPOINT`` or a proxy) is replaced whole: ``scheme://***@host``. A URL with a user
  and no password (``https://NAME@host``) is redacted the same way, since the "user" of such a
  URL is often a token (``https://hf_xxx@host``); the scheme, host, port and path are kept.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "REDACTED",
    "MIN_TOKEN_CHARS",
    "find_named_secrets",
    "find_token_shapes",
    "is_secret_name",
    "redact",
    "redact_obj",
    "tokens_in_use",
]

REDACTED = "***"
# Shorter values are not redacted by value (replacing every "abc" in a text would mangle it);
# real access tokens are 30+ characters.
MIN_TOKEN_CHARS = 8
# Hugging Face user/org tokens ("hf_" + 34 characters) and old org API tokens.
_TOKEN_SHAPE_RE = re.compile(r"\b(?:hf_[A-Za-z0-9]{20,}|api_org_[A-Za-z0-9]{20,})\b")
# scheme://USERINFO@host: the user information ends at the last "@" before the host's path,
# query or fragment (a raw "@" in a password included).
_URL_USERINFO_RE = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s?#\"'<>`]+)@")
_SECRET_WORD = r"(?:token|api[_-]?key|secret|password|passwd)"
# A name that carries a secret: "token", "hub_token", "hub-token", "use_auth_token", "api_key",
# "WANDB_API_KEY", "HF_TOKEN" (case-insensitive; the words must end the name).
_SECRET_NAME_RE = re.compile(rf"(?:[A-Za-z0-9]+[_.-])*{_SECRET_WORD}", re.IGNORECASE)
# Tokenizer vocabulary words, not credentials.
_NOT_SECRETS = frozenset(
    f"{word}_token"
    for word in ("pad", "bos", "eos", "unk", "sep", "cls", "mask", "additional_special", "special")
)
_NAME = rf"[A-Za-z0-9_.-]*{_SECRET_WORD}"
# --name VALUE, --name=VALUE, -name VALUE
_FLAG_RE = re.compile(
    rf"(?P<key>(?<![\w-])--?(?P<name>{_NAME})(?:=|\s+))(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"']+)", re.IGNORECASE
)
_VALUE = r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"',}\]]+)"
# "name": "VALUE", 'name': 'VALUE' (JSON, Python dicts); NAME=VALUE, name='VALUE' (variables,
# keyword arguments, without spaces: ``token = next(it)`` in a code sample is not a secret);
# name: VALUE (YAML).
_ASSIGN_RE = re.compile(
    rf"(?P<key>(?<![\w-])(?:(?P<q>[\"'])(?P<name>{_NAME})(?P=q)\s*[:=]\s*|(?P<bare>{_NAME})(?:=|:[ \t]+)))"
    + _VALUE,
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """Whether an argument, variable or key ``name`` carries a secret (``hub_token``, ``--token``,
    ``HF_TOKEN``, ``wandb_api_key``; not ``eos_token`` or ``max_tokens``)."""
    name = name.lstrip("-")
    return bool(_SECRET_NAME_RE.fullmatch(name)) and name.lower().replace("-", "_") not in _NOT_SECRETS


def tokens_in_use(extra: Iterable[str | None] = ()) -> list[str]:
    """The access tokens this process may use: ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN``, the
    cached login (``huggingface_hub.get_token()``) and ``extra``; those of at least
    :data:`MIN_TOKEN_CHARS` characters, longest first."""
    found = [os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN"), *extra]
    try:
        from huggingface_hub import get_token

        found.append(get_token())
    except Exception:  # noqa: BLE001 - an unreadable token file is no token
        pass
    values = {v.strip() for v in found if isinstance(v, str) and len(v.strip()) >= MIN_TOKEN_CHARS}
    return sorted(values, key=lambda v: (-len(v), v))


def _name(match: re.Match[str]) -> str:
    groups = match.groupdict()
    return groups.get("name") or groups.get("bare") or ""


def _mask(match: re.Match[str]) -> str:
    if not is_secret_name(_name(match)):
        return match.group(0)
    value = match.group("value")
    if value.strip("\"'") in ("", REDACTED) or value.strip("\"'").lower() in ("none", "null"):
        return match.group(0)
    quote = value[0] if value[:1] in "\"'" and len(value) > 1 else ""
    return f"{match.group('key')}{quote}{REDACTED}{quote}"


def _redact(text: str, tokens: list[str]) -> str:
    for token in tokens:
        text = text.replace(token, REDACTED)
    text = _FLAG_RE.sub(_mask, text)
    text = _ASSIGN_RE.sub(_mask, text)
    text = _URL_USERINFO_RE.sub(_mask_userinfo, text)
    return _TOKEN_SHAPE_RE.sub(REDACTED, text)


def _mask_userinfo(match: re.Match[str]) -> str:
    return f"{match.group('scheme')}{REDACTED}@"


def redact(text: str, values: Iterable[str | None] = ()) -> str:
    """``text`` with every secret replaced by ``***``: values given to secret names, Hugging Face
    token shapes, the user information of URLs (``http://user:pass@host`` is
    ``http://***@host``), and the tokens in use (:func:`tokens_in_use` with ``values``)."""
    return _redact(text, tokens_in_use(values))


def redact_obj(obj: Any, values: Iterable[str | None] = ()) -> Any:
    """A copy of a JSON-like value with every string passed through :func:`redact`, and the value
    of every key named like a secret (``"hub_token": ...``) replaced by ``***``."""
    return _redact_obj(obj, tokens_in_use(values))


def _redact_obj(obj: Any, tokens: list[str]) -> Any:
    if isinstance(obj, str):
        return _redact(obj, tokens)
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            new_key = _redact(key, tokens) if isinstance(key, str) else key
            secret = isinstance(key, str) and is_secret_name(key) and value not in (None, "", REDACTED)
            out[new_key] = REDACTED if secret else _redact_obj(value, tokens)
        return out
    if isinstance(obj, (list, tuple)):
        return [_redact_obj(v, tokens) for v in obj]
    return obj


def find_token_shapes(text: str) -> list[str]:
    """The strings shaped like Hugging Face access tokens (``hf_...``, ``api_org_...``) in ``text``."""
    return [m.group(0) for m in _TOKEN_SHAPE_RE.finditer(text)]


def find_named_secrets(text: str) -> list[str]:
    """The values given to secret names in ``text`` (``--hub_token X``, ``HF_TOKEN=X``, ...) that
    are not redacted yet."""
    found = []
    for regex in (_FLAG_RE, _ASSIGN_RE):
        for match in regex.finditer(text):
            value = match.group("value").strip("\"'")
            if (
                is_secret_name(_name(match))
                and value not in ("", REDACTED)
                and value.lower() not in ("none", "null")
            ):
                found.append(match.group(0))
    return found
