"""One model, one run: the checks that the sources of a merge are snapshots of one model (their
configurations mean the same weights) and of one run (a run folder is not mixed with others).

:func:`check_same_model` compares the sources' ``config.json`` fields that change what the
weights mean (:data:`MEANING_FIELDS`, :func:`config_differences`) before any tensor is read;
:func:`check_one_run` refuses a run folder (or a Hub repo read through ``--revisions``) given with
sources outside it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_pma.io.guarded import read_json
from hf_pma.merging.checkpoint_source import CheckpointSource
from hf_pma.merging.hub_revisions import parse_hub_spec
from hf_pma.merging.run_layouts import run_layout
from hf_pma.merging.weight_files import file_present
from hf_pma.utils.logs import get_logger
from hf_pma.utils.names import looks_local
from hf_pma.utils.parsing import is_int
from hf_pma.utils.text import escape, shown

logger = get_logger(__name__)

__all__ = ["MEANING_FIELDS", "config_differences", "check_same_model", "check_one_run"]


# The fields of config.json whose difference makes two checkpoints two different models even
# where every tensor shape matches (heads and head size trade against each other, RoPE and the
# activation change what the same weights compute). Compared where both configurations hold
# them; the head size, the key-value heads and RoPE are compared as what they mean (see
# _meaning), whichever way a transformers version writes them. Settings that do not change the
# meaning of the weights (dropout, max_position_embeddings, token ids, dtype) are not compared.
MEANING_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "n_embd",
    "d_model",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "hidden_act",
    "activation_function",
    "partial_rotary_factor",
    "rotary_pct",
    "position_embedding_type",
    "num_experts_per_tok",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
)
# adapter_config.json (PEFT): what scales or places the same adapter weights differently.
_ADAPTER_FIELDS = ("peft_type", "lora_alpha", "use_rslora", "use_dora", "target_modules")
# Sub-configurations of composite models, compared field by field the same way.
_NESTED_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def _rope(config: dict[str, Any]) -> tuple[Any, Any]:
    """``(rope_theta, the other RoPE settings)`` whichever way the configuration writes them
    (``rope_theta`` and ``rope_scaling`` at the top, as transformers 4 writes them, or
    ``rope_parameters``, as transformers 5 does; ``type`` or ``rope_type``, ``default`` when none)."""
    theta = config.get("rope_theta")
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            return theta, value  # one set per layer type (Gemma 3): compared whole
        if isinstance(value, dict):
            params.update(value)
    if "rope_theta" in params:
        value = params.pop("rope_theta")
        theta = value if theta is None else theta
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    return theta, params


def _meaning(config: dict[str, Any], adapter: bool = False) -> dict[str, Any]:
    """The fields of one configuration that two sources must share, by name (see :data:`MEANING_FIELDS`)."""
    if adapter:
        out = {k: config[k] for k in _ADAPTER_FIELDS if k in config}
        if isinstance(out.get("target_modules"), list):  # a set, written in any order
            out["target_modules"] = sorted(map(str, out["target_modules"]))
        return out
    out = {k: config[k] for k in MEANING_FIELDS if k in config}
    heads = config.get("num_attention_heads", config.get("n_head"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    head_dim = config.get("head_dim")
    if head_dim is None and is_int(heads, 1) and is_int(hidden):
        head_dim = hidden // heads
    if head_dim is not None:
        out["head size (head_dim or hidden_size/num_attention_heads)"] = head_dim
    kv_heads = config.get("num_key_value_heads", heads)
    if kv_heads is not None:
        out["key-value heads (num_key_value_heads)"] = kv_heads
    if any(k in config for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        theta, params = _rope(config)
        if theta is not None:
            out["rope_theta"] = theta
        out["RoPE (rope_scaling / rope_parameters)"] = params
    for key in _NESTED_CONFIGS:
        if isinstance(config.get(key), dict):
            out.update({f"{key}.{k}": v for k, v in _meaning(config[key]).items()})
    return out


def config_differences(
    first: dict[str, Any], second: dict[str, Any], adapter: bool = False
) -> list[tuple[str, Any, Any]]:
    """``(field, first's value, second's value)`` for every field that changes what the weights
    mean (architecture, heads, head size, key-value heads, RoPE, vocabulary, hidden size, layers,
    tied embeddings, activation, ...; for an adapter its scaling and targets) and that the two
    configurations set differently. A field only one of them sets is not compared."""
    a, b = _meaning(first, adapter), _meaning(second, adapter)
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]]


def _source_config(source: CheckpointSource) -> dict[str, Any] | None:
    """The source's ``config.json`` (``adapter_config.json`` for an adapter) read through the
    bounded reader, confined to the folder the user gave; ``None`` when it has none."""
    path = source.path / ("adapter_config.json" if source.is_adapter else "config.json")
    if not file_present(path):
        return None
    config = read_json(path, source.confined_to, kind="config")
    if not isinstance(config, dict):
        raise ValueError(f"{escape(path)} should hold a JSON object, got {type(config).__name__}")
    return config


def check_same_model(sources: Sequence[CheckpointSource], allow_different_configs: bool = False) -> list[str]:
    """Check, before any tensor is read, that the sources are one model: every source's
    ``config.json`` sets the fields that change what the weights mean (:func:`config_differences`)
    as the newest source's does, the configuration the merge copies.

    A difference is a one-line ``ValueError`` naming the two sources, the fields and both values
    (snapshots of two models whose tensor shapes happen to match: 8 heads of 4 against 4 heads
    of 8, another ``rope_theta``). With ``allow_different_configs`` (a deliberate model soup) each
    difference is a warning instead. Returns the differences in words (``[]`` when none), for
    the merge record. A source without a configuration is not compared (logged).
    """
    if len(sources) < 2:
        return []
    reference = sources[-1]
    ref_config = _source_config(reference)
    if ref_config is None:
        return []
    found: list[str] = []
    unknown = []
    for source in sources[:-1]:
        config = _source_config(source)
        if config is None:
            unknown.append(escape(source.name))
            continue
        diffs = config_differences(config, ref_config, reference.is_adapter)
        if not diffs:
            continue
        fields = "; ".join(f"{field} {shown(a, 80)} vs {shown(b, 80)}" for field, a, b in diffs)
        line = f"{escape(source.path)} and {escape(reference.path)} are different models: config.json differs in {fields}"
        if not allow_different_configs:
            raise ValueError(
                f"{line}; merge the checkpoints of one model (pass --allow-different-configs, "
                "allow_different_configs=True, for a deliberate soup of different configurations)"
            )
        logger.warning(
            f"{line}; merged anyway (allow_different_configs), with the configuration of {escape(reference.name)}"
        )
        found.extend(
            f"{escape(source.name)}: {field} {shown(a, 80)} vs {shown(b, 80)}" for field, a, b in diffs
        )
    if unknown:
        logger.info(
            f"no configuration to compare in {', '.join(unknown[:5])}: assumed to be the model of {escape(reference.name)}"
        )
    return found


def _is_whole_run(item: Any, revisions: str | None) -> bool:
    """Whether an input stands for many sources ordered by progress: a run folder, or a Hub repo
    read through ``revisions``."""
    path = Path(item)
    if path.is_dir():
        return run_layout(path).is_run
    if path.exists() or revisions is None:
        return False
    spec = parse_hub_spec(item) if isinstance(item, str) and not looks_local(item) else None
    return spec is not None and spec[1] is None


def _inside(item: Any, folder: Any) -> bool:
    path, root = Path(item), Path(folder)
    if not path.exists() or not root.is_dir():
        return False
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def check_one_run(inputs: Sequence[str | os.PathLike[str]], revisions: str | None = None) -> None:
    """Sources of different runs are merged only when named one by one.

    A run folder (a PMA manifest or ``checkpoint-*`` folders) stands for all its snapshots, and
    a Hub repo read through ``--revisions`` for its revisions, ordered by tokens: given with
    anything outside it (another run, a snapshot of another run), the two would be interleaved
    by tokens, and a window (``--last``, ``--window-tokens``) drawn across both. One-line
    ``ValueError`` naming the two; a run folder with its own weight file (``RUN
    RUN/model.safetensors``) is one run. Explicit lists of snapshot folders, from any runs, pass.
    """
    if len(inputs) < 2:
        return
    for item in inputs:
        if not _is_whole_run(item, revisions):
            continue
        other = next((x for x in inputs if x is not item and not _inside(x, item)), None)
        if other is not None:
            what = (
                "a run folder"
                if Path(item).is_dir()
                else f"a Hub repo read through revisions {shown(revisions)} (revisions=, --revisions)"
            )
            raise ValueError(
                f"{escape(item)} is {what}, and it stands for all its snapshots: given with {escape(other)}, "
                "the sources of two runs would be ordered together by tokens (and a window, last or window_tokens, "
                "--last or --window-tokens, drawn across both); merge one run at a time, or name each snapshot folder to merge sources of "
                "several runs"
            )
