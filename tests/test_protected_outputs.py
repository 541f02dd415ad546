"""An output never replaces what a run or a model is made of, nor what a user put beside it.

Real folders written by the real code: a run trained by the Trainer with ``PMACallback`` (its
manifest, snapshots and ``checkpoint-*`` folders), a model saved by ``save_pretrained`` with
its tokenizer, a merge and a folder of tasks written by ``hf-pma``. Every command's output
(``-o``, ``--plot``, ``--best``) aimed at each file they are made of, or into each of those
folders, is refused in one line before any work, and no byte of any of them changes. A merge
replaced with ``--overwrite`` holding anything its record does not list is refused, naming it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

from hf_pma.cli import main
from hf_pma.core.outputs import LATER_RECORDS
from hf_pma.utils.read_files import HF_PMA_RECORD_NAMES, is_read_file_name
from tests.helpers.data import sample_text, write_small_tasks
from tests.helpers.models import make_tiny_model, save_model_folder
from tests.helpers.sharded_files import rows, write_sharded
from tests.helpers.training import TRAIN_SMALL_TPS, train_small


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer):
    """A trained run, a saved model, a merge of the run and generated tasks, in one folder."""
    from hf_pma.snapshots.callback import PMACallback

    root = tmp_path_factory.mktemp("protected")
    run = root / "run"
    train_small(run, [PMACallback(interval_tokens=2 * TRAIN_SMALL_TPS)])
    model = save_model_folder(root / "model", make_tiny_model(seed=0), tiny_tokenizer)
    merged = root / "merged"
    assert main(["merge", str(run), "-o", str(merged), "--last", "2", "-q"]) == 0
    tasks = write_small_tasks(root / "tasks")
    (root / "heldout.txt").write_text(sample_text(1500))
    (root / "empty").mkdir()
    snapshot = sorted((run / "pma").glob("snapshot-*"))[0]
    state = {k: v.contiguous() for k, v in make_tiny_model(seed=1).state_dict().items()}
    sharded = write_sharded(root / "sharded" / "snapshot-64", state, lambda n, t: rows(n, t, 2), config_from=model)
    return {
        "root": root, "run": run, "model": model, "merged": merged, "tasks": tasks, "snapshot": snapshot, "sharded": sharded,
    }


def _file_targets(f) -> dict[str, Path]:
    """Each file a run, a model, a merge or tasks are made of, a new file in each of those
    folders, and a name hf-pma or transformers reads in an empty folder."""
    run, model = f["run"], f["model"]
    return {
        "run manifest": run / "pma" / "manifest.json",
        "snapshot record": f["snapshot"] / "pma.json",
        "snapshot weights": f["snapshot"] / "model.safetensors",
        "trainer state": run / "checkpoint-4" / "trainer_state.json",
        "checkpoint rng": next((run / "checkpoint-4").glob("rng_state*.pth")),
        "config": model / "config.json",
        "generation config": model / "generation_config.json",
        "weights": model / "model.safetensors",
        "tokenizer": model / "tokenizer.json",
        "tokenizer config": model / "tokenizer_config.json",
        "merge record": f["merged"] / "pma_merge.json",
        "merged tokenizer config": f["merged"] / "tokenizer_config.json",
        "tasks record": f["tasks"] / "tasks_info.json",
        "tasks held-out": f["tasks"] / "heldout.jsonl",
        "new file in a model": model / "results.json",
        "new file in a merge": f["merged"] / "results.json",
        "new file in a run's records": run / "pma" / "results.json",
        "new file in a checkpoint": run / "checkpoint-4" / "results.json",
        "new task file": f["tasks"] / "results.yaml",
        "a config name": f["root"] / "empty" / "config.json",
        "a weights name": f["root"] / "empty" / "model-00001-of-00002.safetensors",
        "a record name": f["root"] / "empty" / "pma_merge.json",
        "a case-folded name": f["root"] / "empty" / "Tokenizer.JSON",
    }


def _file_commands(f, target: Path) -> dict[str, list[str]]:
    text = str(f["root"] / "heldout.txt")
    run, target = str(f["run"]), str(target)
    return {
        "inspect -o": ["inspect", run, "-o", target, "--no-diagnostics"],
        "inspect --plot": ["inspect", run, "--plot", target],
        "eval -o": ["eval", str(f["model"]), "--eval-file", text, "-o", target],
        "compare -o": ["compare", run, "--eval-file", text, "-o", target],
        "sweep -o": ["sweep", run, "--eval-file", text, "-o", target, "--no-plot"],
        "sweep --plot": ["sweep", run, "--eval-file", text, "-o", str(f["root"] / "empty" / "s.json"), "--plot", target],
    }


def _refused(capsys, argv: list[str]) -> str:
    code = main([*argv, "-q"])
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hf-pma {argv[0]}: error: "), err
    return lines[0]


def test_no_output_file_replaces_or_joins_a_run_a_model_a_merge_or_tasks(folders, capsys):
    before = _tree_digest(folders["root"])
    for kind, target in _file_targets(folders).items():
        for command, argv in _file_commands(folders, target).items():
            line = _refused(capsys, argv)
            assert "refusing" in line or "lies inside" in line, (kind, command, line)
            assert str(target) in line, (kind, command, line)
    assert _tree_digest(folders["root"]) == before


def test_a_runs_own_folder_takes_outputs_even_with_the_final_model_at_its_top(folders, tmp_path, capsys):
    run = shutil.copytree(folders["run"], tmp_path / "run", symlinks=True)
    for name in ("config.json", "model.safetensors"):  # run_clm and TRL save the final model there
        shutil.copy(folders["model"] / name, run / name)
    assert main(["inspect", str(run), "--no-diagnostics", "-o", str(run / "inspect.json"), "-q"]) == 0
    line = _refused(capsys, ["inspect", str(run), "--no-diagnostics", "-o", str(run / "config.json")])
    assert "config.json is a name hf-pma or transformers reads" in line


def test_no_output_folder_takes_a_read_name_or_goes_into_a_model(folders, capsys):
    f = folders
    before = _tree_digest(f["root"])
    targets = {
        "inside a model": f["model"] / "merged",
        "in a new folder inside a model": f["model"] / "new" / "merged",
        "inside a merge": f["merged"] / "again",
        "inside a checkpoint": f["run"] / "checkpoint-4" / "merged",
        "a tokenizer name": f["root"] / "empty" / "tokenizer.json",
        "a weights name": f["root"] / "empty" / "model.safetensors",
        "a record name": f["root"] / "empty" / "manifest.json",
        "the model's config": f["model"] / "config.json",
    }
    commands = {
        "merge": lambda t: ["merge", str(f["run"]), "-o", str(t), "--last", "2"],
        "merge --overwrite": lambda t: ["merge", str(f["run"]), "-o", str(t), "--last", "2", "--overwrite"],
        "consolidate": lambda t: ["consolidate", str(f["sharded"]), "-o", str(t)],
        "make-tasks": lambda t: ["make-tasks", str(f["root"] / "heldout.txt"), "-o", str(t)],
        "sweep --best": lambda t: [
            "sweep", str(f["run"]), "--eval-file", str(f["root"] / "heldout.txt"),
            "-o", str(f["root"] / "empty" / "s.json"), "--no-plot", "--best", str(t),
        ],
    }
    for kind, target in targets.items():
        for command, argv in commands.items():
            line = _refused(capsys, argv(target))
            assert str(target) in line, (kind, command, line)
    assert _tree_digest(f["root"]) == before
    # A run's merge goes beside its manifest (RUN/pma/merged), as the Trainer writes it.
    assert main(["merge", str(f["run"]), "-o", str(f["run"] / "pma" / "merged"), "--last", "2", "-q"]) == 0


def test_overwrite_replaces_a_merge_only_when_all_of_it_is_hf_pmas(folders, tmp_path, capsys):
    run = folders["run"]
    old = tmp_path / "old"
    assert main(["merge", str(run), "-o", str(old), "--last", "2", "-q"]) == 0
    listed = json.loads((old / "pma_merge.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in old.iterdir())
    # hf-pma's later records (eval, card: the one it generated, by its mark) are its own: replaced with the merge.
    (old / "pma_eval.json").write_text("{}")
    (old / "README.md").write_text("---\n---\n\n<!-- Generated by hf-pma 0.1.0 -->\n# card\n")
    assert main(["merge", str(run), "-o", str(old), "--last", "3", "--overwrite", "-q"]) == 0
    assert not (old / "pma_eval.json").exists()
    capsys.readouterr()
    # What the user put beside it: a LoRA adapter folder, notes.
    (old / "lora").mkdir()
    (old / "lora" / "adapter_model.safetensors").write_bytes(b"the user's adapter")
    (old / "notes.txt").write_text("the user's")
    before = _tree_digest(old)
    line = _refused(capsys, ["merge", str(run), "-o", str(old), "--last", "2", "--overwrite"])
    assert "it holds what hf-pma did not write (lora/, notes.txt)" in line, line
    assert _tree_digest(old) == before
    # A merge whose record lists no files (written by hand, or by a tool that is not hf-pma).
    (old / "lora" / "adapter_model.safetensors").unlink()
    (old / "lora").rmdir()
    (old / "notes.txt").unlink()
    record = json.loads((old / "pma_merge.json").read_text())
    del record["files"]
    (old / "pma_merge.json").write_text(json.dumps(record))
    line = _refused(capsys, ["merge", str(run), "-o", str(old), "--last", "2", "--overwrite"])
    assert "does not list the files hf-pma wrote" in line, line


def test_consolidate_and_make_tasks_record_what_they_wrote(folders, tmp_path, capsys):
    out = tmp_path / "consolidated"
    assert main(["consolidate", str(folders["sharded"]), "-o", str(out), "-q"]) == 0
    files = json.loads((out / "pma.json").read_text())["extra"]["files"]
    assert sorted(files) == sorted(p.name for p in out.iterdir())
    (out / "notes.txt").write_text("the user's")
    line = _refused(capsys, ["consolidate", str(folders["sharded"]), "-o", str(out), "--overwrite"])
    assert "notes.txt" in line and (out / "notes.txt").read_text() == "the user's"
    tasks = shutil.copytree(folders["tasks"], tmp_path / "tasks")
    files = json.loads((tasks / "tasks_info.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in tasks.iterdir())
    (tasks / "mine.yaml").write_text("task: mine\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, start in enumerate(range(0, 6000, 600)):
        (corpus / f"doc{i}.txt").write_text(sample_text(6000)[start : start + 600])
    line = _refused(capsys, ["make-tasks", str(corpus), "-o", str(tasks), "--overwrite"])
    assert "mine.yaml" in line and (tasks / "mine.yaml").read_text() == "task: mine\n"


# ---------------------------------------------------------------- the names, from what is read


def _file_constants(module, suffixes=(".json", ".safetensors", ".bin", ".pt", ".jsonl", ".jinja", ".txt", ".model")):
    return {
        name: value
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and value.endswith(suffixes) and "/" not in value and " " not in value
    }


def test_every_file_transformers_reads_by_name_is_protected():
    modules = ["transformers.utils", "transformers.tokenization_utils_base", "transformers.trainer"]
    found = {}
    for name in modules:
        found.update(_file_constants(importlib.import_module(name)))
    assert len(found) >= 20, found
    missing = {k: v for k, v in found.items() if not is_read_file_name(v)}
    assert missing == {}, missing


def test_every_record_hf_pma_reads_is_protected():
    import pkgutil

    import hf_pma

    found = {}
    for info in pkgutil.walk_packages(hf_pma.__path__, "hf_pma."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found.update(
            {
                f"{info.name}.{k}": v
                for k, v in _file_constants(module, (".json", ".jsonl", ".safetensors")).items()
                if k.endswith("_NAME")  # a record's name; not a default output's (DEFAULT_OUTPUT)
            }
        )
    assert "hf_pma.core.manifest.MERGE_RECORD_NAME" in found
    missing = {k: v for k, v in found.items() if not is_read_file_name(v)}
    assert missing == {}, missing
    assert set(HF_PMA_RECORD_NAMES) >= {n for n in LATER_RECORDS if n.endswith(".json")}
    # Outputs of the commands' own defaults stay allowed.
    assert not any(is_read_file_name(n) for n in ("eval_results.json", "sweep.json", "sweep.png", "results.json"))
    assert re.fullmatch(r"[a-z_.*\-0-9]+", "".join(HF_PMA_RECORD_NAMES))


def test_the_online_average_never_replaces_what_the_user_put_beside_it(tmp_path):
    from hf_pma.snapshots.callback import PMACallback

    train_small(tmp_path / "run", [PMACallback(interval_tokens=2 * TRAIN_SMALL_TPS, online="sma")])
    folder = tmp_path / "run" / "pma" / "online-sma"
    listed = json.loads((folder / "pma_merge.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in folder.iterdir())
    (folder / "notes.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match=r"it holds what hf-pma did not write \(notes.txt\)"):
        train_small(tmp_path / "run", [PMACallback(interval_tokens=2 * TRAIN_SMALL_TPS, online="sma")])
    assert (folder / "notes.txt").read_text() == "the user's"
