"""``PMATrainingArguments``: ``TrainingArguments`` plus the ``pma_*`` options of :class:`PMATrainer`.

Every option is checked in ``__post_init__``, so a typo fails when the arguments are parsed,
not hours into a run. They parse with ``HfArgumentParser`` from the command line and from
YAML/JSON files like any other training argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging as std_logging
import os
import re
from pathlib import Path
from typing import Any

from transformers import TrainingArguments
from transformers.utils import logging

from hf_pma.core.schedule import check_phases
from hf_pma.core.strategies import validate_strategy
from hf_pma.core.window_choice import check_window_count, is_auto
from hf_pma.snapshots.budget import check_max_overhead
from hf_pma.utils.names import parse_hub_id, scheduler_name
from hf_pma.utils.parsing import check_int, closest_options, folded, parse_dataclasses, parse_size
from hf_pma.utils.text import escape, shown

__all__ = [
    "PMATrainingArguments",
    "deepspeed_zero_stage",
    "parse_with_config",
    "quiet_unused_deepspeed",
    "uses_deepspeed",
]

logger = logging.get_logger(__name__)


def deepspeed_zero_stage(deepspeed: str | dict | None) -> int | None:
    """The ZeRO stage of a DeepSpeed set-up: the ``deepspeed`` argument (a dict or a JSON file), else
    what ``accelerate launch`` passes in the environment; ``None`` without DeepSpeed."""
    config = deepspeed
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        try:
            config = json.loads(Path(config).read_text())
        except ValueError:
            return None
    if isinstance(config, dict):
        stage = (config.get("zero_optimization") or {}).get("stage")
        return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
        config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if config_file and config_file.lower() != "none":
            return deepspeed_zero_stage(config_file)
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        return int(stage) if stage.isdigit() else None
    return None


def uses_deepspeed(deepspeed: str | dict | None) -> bool:
    """Whether a run uses DeepSpeed: the ``deepspeed`` argument, or ``accelerate launch``'s."""
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")
    return deepspeed is not None or launched


# What DeepSpeed logs when it is imported on a machine without a GPU. accelerate imports it in every
# Trainer's set-up once it is installed (``[all]`` installs it), whether the run uses it or not.
_DEEPSPEED_ON_CPU = "Setting accelerator to CPU"


class _UnusedDeepSpeedFilter(std_logging.Filter):
    """Drops DeepSpeed's accelerator-detection line (a run without DeepSpeed)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DEEPSPEED_ON_CPU)


def quiet_unused_deepspeed(deepspeed: str | dict | None) -> None:
    """Before a run without DeepSpeed (``deepspeed``: the ``TrainingArguments`` field) imports it
    through accelerate: no "Setting accelerator to CPU ... unable to detect it" line first (a
    filter on DeepSpeed's logger, which it keeps when it sets its level at import). A run with
    DeepSpeed shows it as DeepSpeed logs it."""
    if uses_deepspeed(deepspeed):
        return
    ds_logger = std_logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _UnusedDeepSpeedFilter) for f in ds_logger.filters):
        ds_logger.addFilter(_UnusedDeepSpeedFilter())


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def read_arguments_file(path: str | os.PathLike[str], parser: Any) -> dict[str, Any]:
    """The arguments of a YAML/JSON config file, checked against the names of ``parser``'s
    dataclasses (an ``HfArgumentParser``); one-line errors naming the file."""
    import yaml

    from hf_pma.io.guarded import JSON_LIMITS, parse_json, read_bytes

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {escape(path)} does not exist")
    data = read_bytes(path, path.parent, max_bytes=JSON_LIMITS["config"])
    if path.suffix == ".json":
        values = parse_json(data, f"config file {escape(path)}")  # bounded in depth, one line
    else:
        try:
            values = yaml.safe_load(data)
        except (yaml.YAMLError, RecursionError) as err:  # a tag it will not build (!!python/...) included
            where = getattr(err, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            why = escape(getattr(err, "problem", None) or err)[:120]
            raise ValueError(f"config file {escape(path)} is not valid YAML{at}: {why}") from None
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ValueError(f"{escape(path)}: expected a mapping of argument names to values")
    known = {f.name for dc in parser.dataclass_types for f in dataclasses.fields(dc)}
    unknown = sorted(set(values) - known)
    if unknown:
        meant = [o.lstrip("-") for o in closest_options(f"--{unknown[0]}", parser)]
        hint = f"; did you mean {' or '.join(meant)}?" if meant else ""
        raise ValueError(f"{path}: unknown argument(s) {folded(unknown)}{hint}")
    return values


def parse_with_config(
    parser: Any,
    argv: list[str],
    default_config: str | os.PathLike[str] | None = None,
    spelled: dict[str, str] | None = None,
) -> tuple[Any, ...]:
    """``parser.parse_args_into_dataclasses(argv)`` (an ``HfArgumentParser``; through
    :func:`hf_pma.utils.parsing.parse_dataclasses`: an unknown option refused in one line naming
    the closest) over a config file:
    a YAML/JSON file given as the first argument, else ``default_config``, sets the defaults,
    and the flags after it change them. Without either, the dataclasses' own defaults.

    ``spelled`` maps options the script takes under another name to that name (``{"pma_anneal_steps":
    "--anneal_steps"}``): one spelling per option. Given as a flag or in the config file, such an
    option is a one-line ``ValueError`` naming the script's spelling, and ``--help`` hides it.

    It also bounds every Hub download the script makes from then on (its tokenizer, config and
    model through transformers, its data through datasets) in bytes and time, as hf-pma bounds
    its own (:func:`hf_pma.utils.hub_client.install_hub_client`).
    """
    from hf_pma.utils.hub_client import install_hub_client

    install_hub_client()
    spelled = spelled or {}
    for action in parser._actions:
        if action.dest in spelled:
            action.help = argparse.SUPPRESS
    config = default_config
    if argv and argv[0].endswith(CONFIG_SUFFIXES) and not argv[0].startswith("-"):
        config, argv = argv[0], argv[1:]
    values = read_arguments_file(config, parser) if config is not None else {}
    given = [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")] + list(values)
    for name in given:
        if name in spelled:
            raise ValueError(f"{name}: this script takes {spelled[name]} instead (one spelling per option)")
    parser.set_defaults(**values)
    return parse_dataclasses(parser, argv)


# An option's name in the online average's messages (outside the quoted values they echo) -> its argument.
_ONLINE_WORDS = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|\bonline_alpha\b|\bonline(?=[_= ])""")


def _argument_words(message: str) -> str:
    """A message of :class:`hf_pma.snapshots.online.OnlineAverage` in the arguments' words
    (``online_window_tokens`` -> ``pma_online_window_tokens``, ``online_alpha`` ->
    ``pma_ema_alpha``); a quoted value it shows (what the user gave) is left as it is."""

    def word(match: re.Match[str]) -> str:
        text = match.group(0)
        return text if match.group(1) else "pma_ema_alpha" if text == "online_alpha" else "pma_online"

    return _ONLINE_WORDS.sub(word, message)


@dataclasses.dataclass
class PMATrainingArguments(TrainingArguments):
    """Training arguments with PMA snapshots, merged evaluation, PMA-init and spike recovery.

    Snapshots go to ``<output_dir>/pma`` (see :class:`hf_pma.PMACallback`); the final merge to
    ``<output_dir>/pma/merged``.
    """

    pma_interval_tokens: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Tokens (global, all processes) between snapshots, V. None: chosen from the planned run."},
    )
    # "auto" or a number (a str field: HfArgumentParser gives one type per flag; numbers are read as int).
    pma_window: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "Snapshots merged, N, or auto (default): chosen from the run's records at each merge (the longest "
            "recent constant-LR stretch over which the training loss no longer falls beyond its noise, at most a "
            "quarter of the tokens trained, merged with WMA by default), said in one line and recorded."
        },
    )
    pma_window_tokens: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Merge the snapshots within the last T tokens instead of the newest pma_window (the merge's "
            "duration, which WSM finds matters more than the count); e.g. 10 x pma_interval_tokens."
        },
    )
    pma_strategy: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto (the weights the automatic window chooses with it, WMA; SMA for a window given), sma, wma, "
            "ema, linear-decay, cosine-decay or 1-sqrt-decay."
        },
    )
    pma_ema_alpha: float = dataclasses.field(default=0.2, metadata={"help": "EMA smoothing factor (0, 1]."})
    pma_phases: list[str] = dataclasses.field(
        default_factory=lambda: ["stable", "decay"],
        metadata={"help": "LR phases in which snapshots are taken: warmup, stable, decay."},
    )
    pma_keep_last: int | None = dataclasses.field(
        default=None, metadata={"help": "Keep only the newest K snapshots on disk (K >= pma_window)."}
    )
    pma_save_dtype: str | None = dataclasses.field(
        default=None, metadata={"help": "dtype of snapshot weights (float32, bfloat16, float16); default: the model's."}
    )
    pma_max_shard_size: str = dataclasses.field(default="5GB", metadata={"help": "Largest safetensors shard of a snapshot."})
    pma_max_disk_bytes: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Disk budget of the snapshots ('200GB', bytes). None: the free space of the snapshot folder, "
            "checked before the first step."
        },
    )
    pma_async_write: bool = dataclasses.field(default=True, metadata={"help": "Write snapshots in a background thread."})
    pma_max_overhead: float | None = dataclasses.field(
        default=0.01,
        metadata={
            "help": "Share of training time snapshots may cost (0.01: one percent), measured from the step times over the "
            "first snapshots; the automatic interval is widened when they cost more. None: no budget."
        },
    )
    pma_eval: bool = dataclasses.field(
        default=True, metadata={"help": "Evaluate the merge of the last pma_window snapshots at every evaluation (eval_pma_*)."}
    )
    pma_merge_at_end: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Write the merge of the last pma_window snapshots to <output_dir>/pma/merged. With pma_online "
            "the online average's folder <output_dir>/pma/online-<kind>, written at the end, is the merge: it gets "
            "the run's record and card instead, and nothing else is merged."
        },
    )
    pma_online: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Keep a running float32 average instead of writing snapshot folders: sma, ema (pma_ema_alpha, "
            "pma_online_half_life_tokens or pma_online_half_life_fraction), linear-decay, cosine-decay or 1-sqrt-decay (WSM's decay emulation over "
            "pma_online_window_tokens). Saved with every checkpoint, evaluated as eval_pma_*, written at the end to "
            "<output_dir>/pma/online-<kind> (per-rank files under FSDP / ZeRO-3)."
        },
    )
    pma_online_half_life_tokens: int | None = dataclasses.field(
        default=None,
        metadata={"help": "pma_online=ema: the tokens over which a snapshot's weight halves (replaces pma_ema_alpha)."},
    )
    pma_online_half_life_fraction: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "pma_online=ema: the half-life as a share of the tokens seen so far (e.g. 0.05; horizon-free, "
            "as torchtitan's half_life_fraction: needs no max_steps). Replaces pma_ema_alpha and "
            "pma_online_half_life_tokens."
        },
    )
    pma_online_window_tokens: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "pma_online=sma or a decay kind: average over tumbling windows of this many tokens (the average "
            "restarts at each multiple); the decay kinds need it."
        },
    )
    pma_online_device: str = dataclasses.field(
        default="cpu",
        metadata={
            "help": "Where the online average lives: cpu (host memory; from CUDA the weights are copied on a side "
            "stream and folded in off the training thread) or device (one float32 copy of each rank's weights in "
            "device memory, no host copy)."
        },
    )
    pma_init_from: list[str] | None = dataclasses.field(
        default=None,
        metadata={"help": "Start from merged weights: a merged folder, a snapshot run folder (its last pma_window are merged), several folders, or Hub revisions (org/model@REV)."},
    )
    pma_spike_recovery: bool = dataclasses.field(
        default=False, metadata={"help": "On a loss spike, restore the merge of the last snapshots before it and continue."}
    )
    pma_spike_factor: float = dataclasses.field(
        default=3.0, metadata={"help": "A logged loss above factor x the median of the last pma_spike_window losses is a spike."}
    )
    pma_spike_window: int = dataclasses.field(default=20, metadata={"help": "Logged losses in the spike detector's median."})
    pma_recovery_snapshots: str = dataclasses.field(
        default="auto",
        metadata={"help": "Snapshots before the spike averaged for recovery (the paper used 3), or auto (default): chosen from their records."},
    )
    pma_recovery_reset_optimizer: bool = dataclasses.field(
        default=True, metadata={"help": "Reset the optimizer's moments on recovery (they hold the spike's gradients)."}
    )
    pma_max_recoveries: int = dataclasses.field(
        default=3, metadata={"help": "Stop with an error after this many recoveries instead of looping."}
    )
    pma_push_merged: bool = dataclasses.field(
        default=True,
        metadata={"help": "With push_to_hub, also push the merged model (with its card) to the revision 'pma-merged' of hub_model_id."},
    )
    pma_push_revision: str = dataclasses.field(
        default="pma-merged", metadata={"help": "Branch of hub_model_id that receives the merged model."}
    )
    pma_anneal_steps: int = dataclasses.field(
        default=0,
        metadata={
            "help": "The annealing check: save a checkpoint this many steps before the end and, after training, "
            "fork the run there with the LR decayed to 0 over these steps, to <output_dir>/annealed (needs "
            "lr_scheduler_type constant or constant_with_warmup). 0: no fork."
        },
    )
    pma_anneal_tokens: int | None = dataclasses.field(
        default=None,
        metadata={"help": "The same, given in tokens (global): turned into steps at the run's first step."},
    )
    pma_anneal_decay: str = dataclasses.field(
        default="linear", metadata={"help": "Shape of the fork's decay: linear, cosine or 1-sqrt."}
    )

    def __post_init__(self) -> None:
        if self.pma_eval and deepspeed_zero_stage(self.deepspeed) == 3:
            # Checked first: the Trainer's own set-up of DeepSpeed comes next.
            raise ValueError(
                "pma_eval=True is not supported with DeepSpeed ZeRO-3: its parameters are partitioned placeholders "
                "that merged evaluation of snapshots cannot swap weights into (and the online average's swap into "
                "ZeRO-3 partitions is not tested inside a Trainer); set pma_eval=False (snapshots, the online "
                "average, PMA-init and the final merge still work; evaluate the merge with hf-pma eval), or train "
                "with FSDP, which merged evaluation supports by local slice"
            )
        super().__post_init__()
        self._check_pma_arguments()

    def _check_pma_arguments(self) -> None:
        for name in ("pma_interval_tokens", "pma_window_tokens", "pma_keep_last"):
            check_int(getattr(self, name), name, allow_none=True)
        for name in ("pma_window", "pma_recovery_snapshots"):
            setattr(self, name, check_window_count(getattr(self, name), name, text=True))
        check_int(self.pma_spike_window, "pma_spike_window")
        check_int(self.pma_max_recoveries, "pma_max_recoveries", 0)
        validate_strategy(self.pma_strategy, self.pma_ema_alpha)
        self._check_online()
        self.pma_phases = list(check_phases(self.pma_phases))
        if (
            self.pma_keep_last is not None
            and self.pma_window_tokens is None
            and not is_auto(self.pma_window)
            and self.pma_keep_last < self.pma_window
        ):
            raise ValueError(
                f"pma_keep_last ({self.pma_keep_last}) is smaller than pma_window ({self.pma_window}): "
                f"the merge could never use {self.pma_window} snapshots"
            )
        if (
            self.pma_spike_recovery
            and self.pma_keep_last is not None
            and not is_auto(self.pma_recovery_snapshots)
            and self.pma_keep_last < self.pma_recovery_snapshots
        ):
            raise ValueError("pma_keep_last must be at least pma_recovery_snapshots when pma_spike_recovery is on")
        if self.pma_spike_recovery and self.logging_nan_inf_filter:
            logger.warning(
                "pma_spike_recovery with logging_nan_inf_filter=True: the Trainer hides NaN/Inf losses from the "
                "logs, so such spikes are caught only through the grad norm; set logging_nan_inf_filter=False"
            )
        if not (self.pma_spike_factor > 1.0):
            raise ValueError(f"pma_spike_factor must be greater than 1, got {self.pma_spike_factor!r}")
        check_max_overhead(self.pma_max_overhead, "pma_max_overhead")
        if self.pma_max_disk_bytes is not None and parse_size(self.pma_max_disk_bytes, "pma_max_disk_bytes") < 1:
            raise ValueError(f"pma_max_disk_bytes must be a positive size, got {self.pma_max_disk_bytes!r}")
        if self.pma_save_dtype is not None and self.pma_save_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"pma_save_dtype must be float32, bfloat16 or float16, got {self.pma_save_dtype!r}")
        if isinstance(self.pma_init_from, (str, os.PathLike)):
            self.pma_init_from = [str(self.pma_init_from)]
        self.check_annealing()
        for item in self.pma_init_from or []:
            # Local paths must exist now; a Hub id ("org/name[@REV]") is fetched when the trainer starts.
            if not Path(item).exists() and parse_hub_id(item) is None:
                raise ValueError(f"pma_init_from: {item} does not exist")

    def _check_online(self) -> None:
        """The ``pma_online*`` options, checked together by the online average's own rules (its
        messages with the arguments' names)."""
        from hf_pma.snapshots.online import OnlineAverage

        windows = [self.pma_online_half_life_tokens, self.pma_online_half_life_fraction, self.pma_online_window_tokens]
        if self.pma_online is None and any(w is not None for w in windows):
            raise ValueError(
                "pma_online_half_life_tokens, pma_online_half_life_fraction and pma_online_window_tokens need pma_online"
            )
        try:
            OnlineAverage(
                "sma" if self.pma_online is None else self.pma_online,
                self.pma_ema_alpha,
                half_life_tokens=self.pma_online_half_life_tokens,
                window_tokens=self.pma_online_window_tokens,
                device=self.pma_online_device,
                half_life_fraction=self.pma_online_half_life_fraction,
            )
        except ValueError as err:
            raise ValueError(_argument_words(str(err))) from None
        if self.pma_online is None:
            if self.pma_online_device != "cpu":
                raise ValueError(f"pma_online_device={shown(self.pma_online_device, 60)} needs pma_online")
            return
        if self.pma_keep_last is not None:
            raise ValueError("pma_keep_last has no effect with pma_online (no snapshot folders are written)")
        if self.pma_spike_recovery:
            raise ValueError(
                "pma_spike_recovery restores a merge of the snapshots on disk; pma_online writes none: use one or the other"
            )

    def check_annealing(self) -> None:
        """``ValueError`` naming the option when the annealed fork (``pma_anneal_steps`` /
        ``pma_anneal_tokens``) cannot be made; call it again after changing them or ``max_steps``."""
        from hf_pma.training.annealing import CONSTANT_SCHEDULES, check_decay_type, fork_step

        steps = check_int(self.pma_anneal_steps, "pma_anneal_steps", 0)
        tokens = check_int(self.pma_anneal_tokens, "pma_anneal_tokens", allow_none=True)
        if steps and tokens:
            raise ValueError("give pma_anneal_steps or pma_anneal_tokens, not both")
        check_decay_type(self.pma_anneal_decay, "pma_anneal_decay")
        if not (steps or tokens):
            return
        name = "pma_anneal_steps" if steps else "pma_anneal_tokens"
        if scheduler_name(self) not in CONSTANT_SCHEDULES:
            raise ValueError(
                f"{name} needs a constant-LR run to fork from (lr_scheduler_type constant_with_warmup), got "
                f"lr_scheduler_type {scheduler_name(self)}; or set it to 0"
            )
        if self.save_only_model:
            raise ValueError(f"{name} resumes the optimizer from a checkpoint: it needs save_only_model=False")
        if steps and self.max_steps > 0:
            fork_step(self.max_steps, steps, self)
