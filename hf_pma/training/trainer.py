"""``PMATrainer``: a ``Trainer`` that takes PMA snapshots, evaluates their merge, starts from a
merge (PMA-init), recovers from loss spikes, and writes the final merge.

It composes :class:`hf_pma.PMACallback` for the snapshots themselves, and the merge engine
for every merge. Merged evaluation merges the snapshots straight into the live model's own
shards (each process reads only the elements it holds, or a share of the replicated tensors
that it then broadcasts; see :mod:`hf_pma.merging.slices`), runs the evaluation loop and puts
the live weights back from a per-process CPU copy: no process builds a full merged model, and
``eval_loss`` and ``eval_pma_loss`` arrive in the same log line, in every reporter. The final
merge is written by every process, each its share of the output shards.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import logging

from hf_pma.core.manifest import PMA_SUBDIR, TRAINING_RECORD_NAME
from hf_pma.core.window_choice import WindowChoice, merge_strategy
from hf_pma.merging.chunks import default_workers
from hf_pma.merging.engine import merge_checkpoints, merge_state_dict
from hf_pma.merging.slices import SliceSwap, reshard
from hf_pma.merging.swap import backup_weights, load_weights, restore_weights
from hf_pma.merging.windows import apply_window
from hf_pma.snapshots.callback import PMACallback
from hf_pma.training.annealing import SaveCheckpointAt, anneal_from_checkpoint, annealing_check
from hf_pma.training.arguments import PMATrainingArguments, quiet_unused_deepspeed
from hf_pma.training.recovery import LossSpikeError, SpikeRecovery, pma_init
from hf_pma.training.saving import save_full_model
from hf_pma.utils.distributed import all_ranks_checked, is_peft_model, local_world_size
from hf_pma.utils.fs import atomic_write_json
from hf_pma.utils.logs import enable_logging
from hf_pma.utils.secrets import redact_obj

logger = logging.get_logger(__name__)

__all__ = ["PMATrainer", "PMATrainingArguments", "LossSpikeError", "save_full_model"]

INIT_RECORD_NAME = "pma_init.json"


def _check_online_agrees(given: PMACallback, args: PMATrainingArguments) -> None:
    """``ValueError`` (one line) when ``pma_online*`` asks for another online average than the
    ``PMACallback`` passed in ``callbacks``, which is used instead of one built from the
    arguments: the arguments would be ignored without a word (``pma_online``, and each other
    ``pma_online*`` option the arguments set to other than its default)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(PMATrainingArguments)}
    names = ["online", "online_half_life_tokens", "online_half_life_fraction", "online_window_tokens", "online_device"]
    pairs = [(f"pma_{name}", name) for name in names]
    half_life = args.pma_online_half_life_tokens is not None or args.pma_online_half_life_fraction is not None
    if args.pma_online == "ema" and not half_life:
        pairs.append(("pma_ema_alpha", "online_alpha"))
    for option, name in pairs:
        value, used = getattr(args, option), getattr(given, name)
        if value != used and (option == "pma_online" or value != defaults[option]):
            raise ValueError(
                f"{option}={value!r} but the PMACallback passed in callbacks, which is used instead, has "
                f"{name}={used!r}: set the online average in one place"
            )


class PMATrainer(Trainer):
    """``transformers.Trainer`` with Pre-trained Model Averaging built in.

    Takes ``PMATrainingArguments`` (all ``pma_*`` options); everything else is the Trainer's.
    After ``train()``, ``trainer.pma_merged_dir`` is the merged model's folder (with
    ``pma_merge_at_end``) and ``trainer.pma_recoveries`` lists the loss-spike recoveries.
    """

    def __init__(self, model: Any = None, args: PMATrainingArguments | None = None, *pargs: Any, **kwargs: Any) -> None:
        if args is None:
            args = PMATrainingArguments(output_dir="trainer_output")
        if not isinstance(args, PMATrainingArguments):
            raise TypeError(f"PMATrainer needs PMATrainingArguments, got {type(args).__name__}")
        self.pma_init_record: dict[str, Any] | None = None
        if args.pma_init_from:
            if model is None:
                raise ValueError("pma_init_from needs a model instance (model_init is not supported with it)")
            self.pma_init_record = pma_init(
                model,
                args.pma_init_from,
                window=args.pma_window,
                window_tokens=args.pma_window_tokens,
                strategy=args.pma_strategy,
                alpha=args.pma_ema_alpha,
                what="pma_init_from",
            )
        # A PMACallback passed in ``callbacks`` (e.g. ``online="sma"``) is used instead of one built from pma_* args.
        given = next((c for c in kwargs.get("callbacks") or [] if isinstance(c, PMACallback)), None)
        if given is not None and args.pma_online is not None:
            _check_online_agrees(given, args)
        callback = given or PMACallback(
            interval_tokens=args.pma_interval_tokens,
            phases=args.pma_phases,
            keep_last=args.pma_keep_last,
            save_dtype=args.pma_save_dtype,
            max_shard_size=args.pma_max_shard_size,
            async_write=args.pma_async_write,
            max_disk_bytes=args.pma_max_disk_bytes,
            online=args.pma_online,
            online_alpha=args.pma_ema_alpha,
            online_half_life_tokens=args.pma_online_half_life_tokens,
            online_window_tokens=args.pma_online_window_tokens,
            online_device=args.pma_online_device,
            online_half_life_fraction=args.pma_online_half_life_fraction,
            max_overhead=args.pma_max_overhead,
        )
        self._pma_fork_saver: SaveCheckpointAt | None = None
        if args.pma_anneal_steps or args.pma_anneal_tokens:  # the annealing check: its checkpoint
            self._pma_fork_saver = SaveCheckpointAt(
                anneal_steps=args.pma_anneal_steps or None, anneal_tokens=args.pma_anneal_tokens
            )
        extra = [self._pma_fork_saver] if self._pma_fork_saver else []
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), *([] if given else [callback]), *extra]
        quiet_unused_deepspeed(args.deepspeed)  # accelerate imports DeepSpeed in the Trainer's set-up
        super().__init__(model, args, *pargs, **kwargs)
        enable_logging()  # hf-pma's records at the verbosity the Trainer just set for transformers
        self.pma_callback.accelerator = self.accelerator
        self.pma_merged_dir: Path | None = None
        # The annealed fork of the annealing check (pma_anneal_steps / pma_anneal_tokens), once made.
        self.pma_annealed_dir: Path | None = None
        # The command that reproduces this run, for the model card (scripts set it).
        self.pma_command: str | None = None
        # More of the run for its record and card, e.g. {"datasets": [...], "base_model": ...} (scripts set it).
        self.pma_record_extra: dict[str, Any] = {}
        self._pma_spikes = SpikeRecovery(
            factor=args.pma_spike_factor,
            window=args.pma_spike_window,
            last=args.pma_recovery_snapshots,
            reset_optimizer=args.pma_recovery_reset_optimizer,
            max_recoveries=args.pma_max_recoveries,
            option_prefix="pma_",
        )
        # The loss-spike recoveries of this run, one record each (also in the manifest).
        self.pma_recoveries: list[dict[str, Any]] = self._pma_spikes.recoveries
        self._pma_pending_metrics: dict[str, float] | None = None
        # What the last merged evaluation cost this process (bytes read, CPU backup).
        self.pma_last_merge_stats: dict[str, Any] | None = None
        self._pma_train_start = time.time()
        if self.pma_init_record is not None and self.is_world_process_zero():
            pma_dir = Path(self.args.output_dir) / PMA_SUBDIR
            pma_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(pma_dir / INIT_RECORD_NAME, self.pma_init_record)

    @property
    def pma_callback(self) -> PMACallback:
        """The live ``PMACallback`` (looked up: resuming with ``restore_callback_states_from_checkpoint``
        replaces the instance)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, PMACallback):
                return callback
        raise RuntimeError("the PMACallback was removed from this PMATrainer")

    # ------------------------------------------------------------------ merged evaluation

    def _pma_barrier(self, fn: Any = None, what: str = "waiting for the main process") -> None:
        """Every process runs ``fn`` (if given) then waits for the others on a gloo group with a long
        timeout (a snapshot write or a merge may outlast NCCL's); a failure anywhere is raised everywhere."""
        all_ranks_checked(fn or (lambda: None), what)

    def _pma_workers(self) -> int:
        """Merge threads per process: the usable cores shared by this machine's processes."""
        return max(1, default_workers() // local_world_size())

    def _pma_merge_window(self, last: int | str | None = None) -> tuple[list[Path], str, WindowChoice | None]:
        """The snapshot folders a merge takes (oldest first, identical on every process), its
        strategy, and the automatic window's choice: the newest ``last`` (default ``pma_window``;
        ``"auto"``: chosen from the snapshots' records), or with ``pma_window_tokens`` those within
        the last T tokens."""
        # The main process finishes the write in flight; the others then read the same manifest.
        self._pma_barrier(self.pma_callback.wait, "waiting for the snapshot being written")
        snapshots = self.pma_callback.snapshots()
        window_tokens = None if last is not None else self.args.pma_window_tokens
        window = last if last is not None else (None if window_tokens else self.args.pma_window)
        chosen, choice = apply_window(snapshots, last=window, window_tokens=window_tokens, fewer=True)
        paths = [path for _record, path in chosen]
        strategy, choice = merge_strategy(self.args.pma_strategy, choice, len(paths))
        return paths, strategy, choice

    def pma_merged_state_dict(self, last: int | str | None = None, strategy: str | None = None) -> dict[str, torch.Tensor] | None:
        """The full merge of the newest ``last`` (default ``pma_window``; ``"auto"``: chosen from the
        snapshots' records) snapshots, or ``None`` if none yet.

        Builds a whole merged state dict in this process's memory (merged evaluation does not:
        it merges by local slice); every process calling it reads every snapshot.
        """
        paths, default, choice = self._pma_merge_window(last)
        if not paths:
            return None
        # A strategy given here ("auto" too) is resolved against the window's own choice.
        strategy = merge_strategy(strategy, choice, len(paths))[0] if strategy else default
        return merge_state_dict(paths, strategy=strategy, alpha=self.args.pma_ema_alpha, workers=self._pma_workers())

    def _evaluate_merge(self, eval_dataset: Any, ignore_keys: list[str] | None, prefix: str) -> dict[str, float]:
        online = self.pma_callback.online is not None
        paths, strategy, choice = ([], None, None) if online else self._pma_merge_window()
        if not paths and not online:
            return {}
        if choice is not None:
            logger.info(f"merged evaluation: {choice.describe()}")
        start = time.perf_counter()
        if online:  # the online average, each process its own slices (no snapshot on disk)
            reshard(self.model)
            swapped = self.pma_callback.swap_in_online(self.model)
            if swapped is None:
                return {}
            restore = lambda: (reshard(self.model), swapped())  # noqa: E731
            self.pma_last_merge_stats = None
        elif is_peft_model(self.model):  # adapter-only snapshots: small, loaded through peft
            backup = backup_weights(self.model)
            load_weights(self.model, merge_state_dict(paths, strategy=strategy, alpha=self.args.pma_ema_alpha))
            restore = lambda: restore_weights(self.model, backup)  # noqa: E731
            self.pma_last_merge_stats = None
        else:
            swap = SliceSwap(
                self.model, paths, strategy=strategy, alpha=self.args.pma_ema_alpha, workers=self._pma_workers()
            )
            restore = swap.restore
            self.pma_last_merge_stats = {"bytes_read": swap.bytes_read, "backup_bytes": swap.backup_bytes}
        merge_s = time.perf_counter() - start
        try:
            output = self.evaluation_loop(
                self.get_eval_dataloader(eval_dataset),
                description="PMA merge evaluation",
                prediction_loss_only=True if self.compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=f"{prefix}_pma",
            )
        finally:
            restore()
        metrics = dict(output.metrics)
        metrics[f"{prefix}_pma_num_snapshots"] = self.pma_callback.online_count if online else len(paths)
        metrics[f"{prefix}_pma_merge_runtime"] = round(merge_s, 4)
        return metrics

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate the live model and, with ``pma_eval``, the merge of the last snapshots.

        The merge's metrics carry the prefix ``<metric_key_prefix>_pma_`` and are logged in the
        same log entry as the live model's.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if not self.args.pma_eval or isinstance(dataset, dict):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # dicts recurse per dataset
        pma_metrics = self._evaluate_merge(eval_dataset, ignore_keys, metric_key_prefix)
        self._pma_pending_metrics = pma_metrics
        try:
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._pma_pending_metrics = None
        metrics.update(pma_metrics)
        return metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's ``log``, plus the merged metrics in the evaluation's entry and spike checks."""
        if self._pma_pending_metrics and any(k.endswith("_loss") or k.endswith("_runtime") for k in logs):
            logs.update(self._pma_pending_metrics)
            self._pma_pending_metrics = None
        super().log(logs, start_time)
        if self.args.pma_spike_recovery and "loss" in logs and self.model is not None and self.model.training:
            self._check_for_spike(logs)

    # ------------------------------------------------------------------ loss-spike recovery

    def _check_for_spike(self, logs: dict[str, float]) -> None:
        """A logged training loss: on a spike, :class:`hf_pma.training.recovery.SpikeRecovery`
        restores the merge of the snapshots before it; the recovery is logged."""
        record = self._pma_spikes.check(
            logs["loss"],
            logs.get("grad_norm"),
            model=self.model,
            taker=self.pma_callback.taker,
            step=self.state.global_step,
            tokens=int(self.state.num_input_tokens_seen),
            optimizer=self.optimizer,
        )
        if record is None:
            return
        self.log(
            {
                "pma_recovery": float(len(self.pma_recoveries)),
                "pma_recovery_step": float(record["step"]),
                "pma_recovery_spike_loss": float(logs["loss"]),
                "pma_recovery_num_snapshots": float(len(record["snapshots"])),
            }
        )

    # ------------------------------------------------------------------ the end of training

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, then (with ``pma_merge_at_end``) the final merge and its records."""
        self._pma_train_start = time.time()
        output = super().train(*args, **kwargs)
        if self.args.pma_merge_at_end and self.pma_callback.online is not None:
            self.pma_merged_dir = self._pma_online_merge()  # the online average, written at train end, is the merge
        elif self.args.pma_merge_at_end:
            self.pma_merged_dir = self.merge_snapshots()
            if self.pma_merged_dir is not None and self.args.push_to_hub and self.args.pma_push_merged:
                self.push_merged_to_hub(revision=self.args.pma_push_revision)
        if self._pma_fork_saver is not None and self._pma_fork_saver.step is not None:
            self.pma_annealed_dir = self._anneal_at_end(self._pma_fork_saver)
        return output

    def _anneal_at_end(self, saver: SaveCheckpointAt) -> Path | None:
        """The fork of the annealing check, from the checkpoint ``saver`` made; that checkpoint is
        deleted afterwards unless the run's own save strategy wanted it."""
        checkpoint = Path(self.args.output_dir) / f"checkpoint-{saver.step}"
        if not checkpoint.is_dir():
            logger.warning(
                f"no {checkpoint.name} to fork the annealed model from (deleted by save_total_limit, or the run "
                "resumed past it): no annealed fork"
            )
            return None
        self._pma_release_optimizer()
        out = anneal_from_checkpoint(
            self, checkpoint, steps=saver.anneal_steps, decay_type=self.args.pma_anneal_decay
        )
        if saver.forced:
            from hf_pma.utils.fs import remove_tree

            self._pma_barrier(lambda: remove_tree(checkpoint) if self.is_world_process_zero() else None)
        return out

    def _pma_release_optimizer(self) -> None:
        """Free the finished run's optimizer moments before the fork builds its own (a second
        ``train()`` makes a new optimizer); not under DeepSpeed, which owns its optimizer."""
        if self.optimizer is None or self.is_deepspeed_enabled:
            return
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            inner.state.clear()
        self.optimizer, self.lr_scheduler = None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def annealing_check(self, texts: list[str], **kwargs: Any) -> dict[str, Any]:
        """Evaluate the last snapshot, the merge and the annealed model on the same held-out
        ``texts`` and write the paired comparison into the merged folder's ``pma_eval.json`` and
        card: :func:`hf_pma.training.annealing.annealing_check` (its keywords: ``annealed``,
        ``tasks``, ``include_path``, ``block_size``, ``eval_dataset``, ``live``). Call it on every process."""
        return annealing_check(self, texts, **kwargs)

    def merge_snapshots(self, output_dir: str | Path | None = None, last: int | str | None = None) -> Path | None:
        """Merge the newest ``last`` (default ``pma_window``; ``"auto"``: chosen from the snapshots'
        records, said in one line and recorded with its reason) snapshots into ``output_dir``.

        Default folder: ``<output_dir>/pma/merged`` (replaced if present). Also writes the run's
        record (``pma_training.json``) beside the weights. Returns the folder, or ``None`` when
        no snapshot was taken.
        """
        paths, strategy, choice = self._pma_merge_window(last)
        target = Path(output_dir) if output_dir else Path(self.args.output_dir) / PMA_SUBDIR / "merged"
        if not paths:
            logger.warning("No PMA snapshot was taken during training: nothing to merge.")
            return None
        # Every process writes its share of the output shards; the main process the rest.
        merge_checkpoints(
            paths,
            target,
            strategy=strategy,
            alpha=self.args.pma_ema_alpha,
            overwrite=True,
            progress=not self.args.disable_tqdm,
            workers=self._pma_workers(),
            distributed=self.args.world_size > 1,
            window_tokens=None if last else self.args.pma_window_tokens,
            window_choice=choice,
        )
        if choice is not None and self.is_world_process_zero():
            logger.warning(f"PMA merge into {target}: {choice.describe()}")

        self._pma_barrier(lambda: self._pma_write_records(target), f"writing the record and card of {target}")
        return target

    def _pma_write_records(self, target: Path) -> None:
        """Main process: the run's record (``pma_training.json``) and the model card beside a merge."""
        if not self.is_world_process_zero():
            return
        atomic_write_json(target / TRAINING_RECORD_NAME, self.pma_training_record())
        from hf_pma.publishing.card import write_model_card

        write_model_card(target, repo_id=self.args.hub_model_id)

    def _pma_online_merge(self) -> Path | None:
        """Every process: the online average's folder (``<output_dir>/pma/online-<kind>``, written
        by the callback at train end) with the run's record and card; ``None`` when it holds no
        snapshot."""
        from hf_pma.core.manifest import MERGE_RECORD_NAME
        from hf_pma.utils.fs import is_library_folder

        self._pma_barrier()  # the main process has written it
        sink = self.pma_callback.sink
        target = getattr(sink, "target", None)
        if target is None or not is_library_folder(target, MERGE_RECORD_NAME):
            logger.warning("No PMA snapshot was taken during training: the online average is empty, nothing to merge.")
            return None
        self._pma_barrier(lambda: self._pma_write_records(target), f"writing the record and card of {target}")
        return target

    def pma_training_record(self) -> dict[str, Any]:
        """What the card and the plot need to know about this run (no paths, no tokens: the
        command and every string are redacted by name and by value, ``hub_token`` included)."""
        args = self.args
        device = "cpu" if args.use_cpu or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
        record = {
            "log_history": self.state.log_history,
            "total_tokens": int(self.state.num_input_tokens_seen),
            "max_steps": int(self.state.max_steps),
            "global_step": int(self.state.global_step),
            "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "lr_scheduler_kwargs": json.loads(json.dumps(args.lr_scheduler_kwargs or {}, default=str)),
            "learning_rate": args.learning_rate,
            "seed": args.seed,  # what hf-pma compare --group seed groups by
            "warmup_steps": args.warmup_steps,
            "hardware": f"{args.world_size} x {device}",
            "world_size": args.world_size,
            "train_runtime_s": time.time() - self._pma_train_start,
            "interval_tokens": self.pma_callback.interval_tokens,
            "pma_window": args.pma_window,
            "pma_window_tokens": args.pma_window_tokens,
            "pma_strategy": args.pma_strategy,
            "pma_online": self.pma_callback.online,
            "pma_init": self.pma_init_record,
            "command": self.pma_command,
            "recoveries": self.pma_recoveries,
            "pma_evals": [
                {k: e.get(k) for k in ("step", "num_input_tokens_seen", "eval_loss", "eval_pma_loss")}
                for e in self.state.log_history
                if "eval_pma_loss" in e
            ],
        }
        record.update(self.pma_record_extra)
        return redact_obj(record, [args.hub_token])

    def push_merged_to_hub(
        self,
        repo_id: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        commit_message: str | None = None,
        token: str | None = None,
    ) -> str | None:
        """Push the merged folder (with its model card) to the Hub; returns the commit URL.

        ``repo_id`` defaults to ``hub_model_id`` (else the output folder's name, as the Trainer
        does); ``revision`` to the main branch. Main process only; others return ``None``.
        """
        if self.pma_merged_dir is None:
            raise ValueError("no merged model yet: train with pma_merge_at_end, or call merge_snapshots() first")
        if not self.is_world_process_zero():
            return None
        from hf_pma.publishing.hub import push_folder_to_hub

        repo_id = repo_id or self.args.hub_model_id or Path(self.args.output_dir).resolve().name
        return push_folder_to_hub(
            self.pma_merged_dir,
            repo_id,
            private=bool(private if private is not None else self.args.hub_private_repo),
            revision=revision,
            commit_message=commit_message or "Upload PMA merged model",
            token=token or self.args.hub_token,
        )
