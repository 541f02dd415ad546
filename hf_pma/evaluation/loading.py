"""Load a model and its tokenizer for evaluation from a folder or a Hub id, checked first.

:func:`load_model_for_eval` resolves the model (a snapshot, a merge, a Trainer output; a PMA run
folder is refused) and its tokenizer (the folder's own, else its run folder's), checks that the
tokenizer fits the model's embedding (:func:`check_tokenizer`) from the configuration before
the weights are read, and loads with ``trust_remote_code=False``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_pma.evaluation.model_checks import (
    LOAD_KWARGS,
    check_loadable_folder,
    custom_code_error,
    resolve_model,
)
from hf_pma.io.guarded import check_one_version, one_version, pin_folder
from hf_pma.utils.fs import read_claim
from hf_pma.utils.hub_client import install_hub_client
from hf_pma.utils.text import escape

logger = logging.get_logger(__name__)

__all__ = ["check_tokenizer", "load_tokenizer", "config_vocab_rows", "load_model_for_eval"]


def check_tokenizer(vocab_rows: int, tokenizer: Any, model_name: str, tokenizer_name: str) -> None:
    """``ValueError`` when ``tokenizer`` cannot belong to a model with ``vocab_rows`` embedding
    rows: it makes ids past the end of the embedding. (Fewer tokens than rows is normal: vocabularies
    are often padded; far fewer is logged as a warning.)"""
    size = len(tokenizer)
    if size > vocab_rows:
        raise ValueError(
            f"tokenizer {tokenizer_name} does not match model {model_name}: it has {size} tokens but the model's "
            f"embedding has {vocab_rows} rows (pass the model's own tokenizer: tokenizer=, --tokenizer)"
        )
    if size < 0.9 * vocab_rows:
        logger.warning(
            f"tokenizer {tokenizer_name} has {size} tokens, model {model_name} has {vocab_rows} embedding rows: "
            "make sure it is the tokenizer the model was trained with"
        )


def load_tokenizer(name: str) -> Any:
    """The tokenizer of a folder (checked: no custom code) or a Hub id; one-line errors naming it."""
    from transformers import AutoTokenizer

    if Path(name).is_dir():
        check_loadable_folder(name)
    else:
        install_hub_client()  # transformers downloads it: bounded in bytes and time, like hf-pma's own
    try:
        return AutoTokenizer.from_pretrained(name, **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise custom_code_error(name, err) or FileNotFoundError(
            f"cannot load tokenizer {name}: {err}"
        ) from None


def config_vocab_rows(name: str) -> int | None:
    """The embedding rows ``config.json`` of a folder or Hub id declares (its text part's for a
    composite model); ``None`` when it says none."""
    from transformers import AutoConfig

    if Path(name).is_dir():
        check_loadable_folder(name)  # no custom code; config.json read through the bounded reader first
    else:
        install_hub_client()  # transformers downloads it: bounded in bytes and time, like hf-pma's own
    try:
        config = AutoConfig.from_pretrained(name, **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise custom_code_error(name, err) or FileNotFoundError(
            f"model {name} is not readable: {err}"
        ) from None
    config = getattr(config, "text_config", None) or config
    return getattr(config, "vocab_size", None)


def load_model_for_eval(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Any | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for evaluation from a model folder (snapshot, merge, Trainer
    output) or a Hub id, checked: ``FileNotFoundError`` for an unreadable folder, ``ValueError``
    for a PMA run folder or a tokenizer that does not match the model.

    ``tokenizer`` (a name, folder or tokenizer object) defaults to the model folder's own, or the
    nearest one among its two parent folders (a snapshot's run folder).

    A model folder is read under its claim, shared (:func:`hf_pma.utils.fs.read_claim`): a merge
    replacing it meanwhile (``--overwrite``) waits for the load, or the load for it, so the
    config, weights and tokenizer all come from one version of the folder; a folder that does
    not take claims (another tool writing it) is read as one version too, or refused with a
    :class:`~hf_pma.io.guarded.SourceChangedError` naming the file that changed meanwhile.
    """
    folder = Path(model)
    with read_claim(folder, what="model folder") if folder.is_dir() else contextlib.nullcontext():
        with one_version(folder):
            return _load_model_for_eval(model, tokenizer, dtype, device)


def _load_model_for_eval(
    model: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Any | None,
    dtype: str | torch.dtype,
    device: str | torch.device | None,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    from hf_pma.io.sharded import sharded_weight_files
    from hf_pma.merging.consolidate import load_sharded_model

    tok_obj = None if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if tok_obj is not None:
        name, _ = resolve_model(model, None, find_tokenizer=False)
        tok, tok_name = tok_obj, type(tok_obj).__name__
    else:
        name, tok_name = resolve_model(model, tokenizer)
        pin_folder(tok_name)  # a tokenizer folder (its run folder's): one version too
        tok = load_tokenizer(tok_name)
    rows = config_vocab_rows(name)
    if rows is not None:  # cheap check before the weights are read
        check_tokenizer(rows, tok, name, tok_name)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) or dtype == "auto" else getattr(torch, str(dtype))
    try:
        if Path(name).is_dir() and sharded_weight_files(name) is not None:
            loaded = load_sharded_model(name, dtype=torch_dtype)
        else:
            loaded = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise custom_code_error(name, err) or FileNotFoundError(
            f"model {name} is not readable: {err}"
        ) from None
    except RuntimeError as err:  # a config.json whose shapes disagree with the weights (size mismatch)
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ValueError(f"model {escape(name)} does not load: {escape(first.strip())}") from None
    check_tokenizer(loaded.get_input_embeddings().weight.shape[0], tok, name, tok_name)
    check_one_version()  # transformers read the files checked above by name: still that version
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded.to(device).eval()
    return loaded, tok
