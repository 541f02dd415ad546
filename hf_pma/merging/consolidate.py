"""Turn one sharded snapshot (one file per rank) into a plain Hugging Face model folder.

Streams tensor by tensor in bounded memory (flat element ranges assembled from the ranks'
slices, see :mod:`hf_pma.io.sharded`), optionally casting floating tensors, into
``model.safetensors`` or ``model-0000x-of-0000y.safetensors`` + index, with the snapshot's
config, tokenizer files and record; the folder is built aside and renamed into place. Casts
run in numpy with torch's rounding (:mod:`hf_pma.merging.casts`): neither torch nor
transformers is imported.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hf_pma.core.manifest import MERGE_RECORD_NAME, SNAPSHOT_RECORD_NAME
from hf_pma.core.outputs import record_own_files
from hf_pma.io.guarded import check_one_version, reads_one_version
from hf_pma.io.safetensors import SafetensorsWriter
from hf_pma.merging.casts import decode_float, encode_float
from hf_pma.merging.checkpoint_source import open_all
from hf_pma.merging.engine import (
    _check_output,
    _copy_support_files,
    _replaceable,
    check_config_file,
    plan_output_shards,
    plan_tensors,
    write_shard_index,
)
from hf_pma.merging.sources import CheckpointSource, resolve_sources
from hf_pma.utils.fs import (
    atomic_write_json,
    claim_output,
    publish_folder,
    remove_stale_temporaries,
    temporary_path,
)
from hf_pma.utils.logs import get_logger, progress_bar
from hf_pma.utils.parsing import parse_dtype, parse_dtype_name, parse_size

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

__all__ = ["consolidate_snapshot", "load_sharded_model"]

_CHUNK_ELEMS = 1 << 20
# What --overwrite replaces: an earlier consolidation (its pma.json) or merge, nothing else.
_MARKERS = (SNAPSHOT_RECORD_NAME, MERGE_RECORD_NAME)


@reads_one_version
def consolidate_snapshot(
    snapshot: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write the sharded snapshot ``snapshot`` as one HF model folder ``output_dir``; returns it.

    ``snapshot`` is a folder of per-rank ``shard-*-model-*.safetensors`` files (an hf-pma sharded
    snapshot, or a folder written by torch DCP's ``HuggingFaceStorageWriter(save_distributed=True)``
    with a ``config.json`` beside). ``dtype`` casts floating tensors. The values are the stored
    ones, bit for bit, when no ``dtype`` is given. The snapshot is read as one version: a file
    of it changed meanwhile is a :class:`~hf_pma.io.guarded.SourceChangedError`, and nothing is
    published.
    """
    out_dtype = parse_dtype_name(dtype)
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    output_dir = Path(output_dir)
    (source,) = resolve_sources([snapshot]) if Path(snapshot).is_dir() else (None,)
    if source is None or not source.sharded:
        raise ValueError(
            f"{snapshot} is not a sharded snapshot (no per-rank shard-*-model-*.safetensors files)"
        )
    check_config_file(source)
    # --overwrite replaces an earlier consolidation (its pma.json) or merge, nothing else.
    _check_output(output_dir, [source], overwrite, markers=_MARKERS)
    with claim_output(output_dir, overwrite):  # exclusive until published
        _consolidate_into(source, output_dir, out_dtype, max_bytes, overwrite, progress)
    return output_dir


def _consolidate_into(
    source: CheckpointSource,
    output_dir: Path,
    out_dtype: str | None,
    max_bytes: int,
    overwrite: bool,
    progress: bool,
) -> None:
    remove_stale_temporaries(output_dir.parent, output_dir.name)  # of a killed earlier run
    tmp = temporary_path(output_dir)
    (tensors,) = open_all([source], raw=True)  # every rank's shard file at once: the open-file limit raised
    try:
        plans = plan_tensors(tensors.infos, out_dtype)
        shards = plan_output_shards(plans, max_bytes, "model")
        tmp.mkdir(parents=True)
        read_buf = np.empty(_CHUNK_ELEMS * 8, dtype=np.uint8)
        decoded = np.empty(_CHUNK_ELEMS, dtype=np.float32)
        cast_buf = np.empty(_CHUNK_ELEMS * 8, dtype=np.uint8)
        bar = progress_bar(total=len(plans), desc="Consolidating", unit="tensor", disable=not progress)
        for shard in shards:
            writer = SafetensorsWriter(
                tmp / shard.filename, [(p.name, p.out_dtype, p.shape) for p in shard.plans]
            )
            for plan in shard.plans:
                for start in range(0, plan.numel, _CHUNK_ELEMS):
                    stop = min(plan.numel, start + _CHUNK_ELEMS)
                    chunk = tensors.read(plan.name, start, stop, read_buf)
                    if plan.out_dtype != plan.in_dtype:  # torch's rounding, bit for bit
                        chunk = encode_float(
                            decode_float(chunk, plan.in_dtype, decoded), plan.out_dtype, cast_buf
                        )
                    writer.write(plan.name, chunk)
                bar.update(1)
            writer.close()
        bar.close()
        write_shard_index(tmp, "model", shards)
        _copy_support_files(source, tmp, out_dtype)
        # Always a record, even for a folder that had none (a DCP checkpoint): it is what marks
        # the output as hf-pma's, which a later --overwrite of it needs.
        record = dict(source.record)
        extra = dict(record.get("extra") or {})
        layout = {k: extra.pop(k) for k in ("sharded", "world_size", "layout") if k in extra}
        extra["consolidated_from"] = {**layout, "num_rank_files": len(source.files)}
        record["extra"] = extra
        if out_dtype is not None:
            record["dtype"] = out_dtype
        atomic_write_json(tmp / SNAPSHOT_RECORD_NAME, record_own_files(tmp, record, SNAPSHOT_RECORD_NAME))
        check_one_version()  # the rank files and support files read are one version of the snapshot
        # What --overwrite replaces is checked again: the user may have added a file meanwhile.
        publish_folder(tmp, output_dir, replace=overwrite, check_replaced=_replaceable(_MARKERS))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        tensors.close()
    logger.info(f"Consolidated {source.path} ({len(source.files)} rank files) into {output_dir}")


@reads_one_version
def load_sharded_model(
    snapshot: str | os.PathLike[str], dtype: str | torch.dtype = "auto"
) -> torch.nn.Module:
    """A causal LM built from a sharded snapshot's ``config.json`` with its weights loaded in memory
    (what ``from_pretrained`` gives for a plain folder; used by evaluation).

    ``dtype``: ``"auto"`` keeps the stored dtype, else floating weights are cast to it. The
    snapshot is read as one version (:func:`hf_pma.io.guarded.one_version`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (source,) = resolve_sources([snapshot])
    if not source.sharded:
        raise ValueError(f"{snapshot} is not a sharded snapshot")
    check_config_file(source)  # confined, regular, a bounded JSON object: before transformers parses it
    with source.open() as tensors:
        state = tensors.state_dict()
    config = AutoConfig.from_pretrained(snapshot, trust_remote_code=False)
    check_one_version()  # transformers read config.json by name: the version checked above, still
    stored = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    target = stored if dtype == "auto" else parse_dtype(dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=target, trust_remote_code=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"sharded snapshot {snapshot} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    return model
