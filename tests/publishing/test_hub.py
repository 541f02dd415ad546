"""Pushing a merged folder to a local stand-in for the Hub, over real HTTP on 127.0.0.1.

The in-process tests give the endpoint to ``HfApi(endpoint=...)`` (``HF_ENDPOINT`` is read when
``huggingface_hub`` is imported); the CLI test runs ``hf-pma push`` in a subprocess with
``HF_ENDPOINT`` and ``HF_TOKEN`` set, as a user would. ``HF_HUB_OFFLINE`` (set for the whole
suite) would block 127.0.0.1 too, so these tests lift it.
"""

from __future__ import annotations

import json
import re

import pytest
from huggingface_hub import ModelCard
from huggingface_hub import constants as hf_constants

from hf_pma.cli import main
from hf_pma.publishing.hub import HubAuthError, check_model_folder, push_folder_to_hub
from tests.helpers.cli import run_cli
from tests.helpers.hub_server import online_cli_env, online_hub
from tests.helpers.pma_records import EVAL_RECORD, FAKE_TOKEN, write_merged_folder

TOKEN = "hf_test_token_for_the_local_hub_0000"


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    with online_hub(monkeypatch, tmp_path, (TOKEN,)) as server:
        yield server


@pytest.fixture()
def merged(tmp_path, tiny_tokenizer):
    return write_merged_folder(tmp_path, tiny_tokenizer, careless=False)


def _local_files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _card_from(data: bytes, tmp_path) -> ModelCard:
    path = tmp_path / "received_README.md"
    path.write_bytes(data)
    return ModelCard.load(path)


def test_push_round_trip(hub, merged, tmp_path):
    assert not (merged / "README.md").exists()
    url = push_folder_to_hub(merged, "my-org/tiny-pma", token=TOKEN, endpoint=hub.url)

    # The card (and its plot) were written before the upload, and everything arrived byte-identical.
    local = _local_files(merged)
    assert {"README.md", "pma_training.png", "model.safetensors", "config.json", "pma_merge.json"} <= set(
        local
    )
    received = hub.files("my-org/tiny-pma")
    assert received == local
    repo = hub.repos["my-org/tiny-pma"]
    assert url == f"{hub.url}/my-org/tiny-pma/commit/{repo.heads['main']}"
    assert not repo.private and repo.commits[-1]["summary"] == "Upload merged with hf-pma"
    assert all(r["has_token"] for r in hub.requests)

    # The received card parses and holds the merge's results in its model-index.
    card = _card_from(received["README.md"], tmp_path)
    assert card.data.model_name == "tiny-pma"
    losses = {
        r.metric_type: r.metric_value for r in card.data.eval_results if r.dataset_type == "held-out-text"
    }
    assert losses["loss"] == EVAL_RECORD["results"]["PMA merge"]["lm"]["loss"]
    assert re.search(r"""from_pretrained\(["']my-org/tiny-pma["']\)""", card.text)

    # Pushing again uploads nothing new: the server's oids match the local files.
    again = push_folder_to_hub(merged, "my-org/tiny-pma", token=TOKEN, endpoint=hub.url)
    assert again == url and len(repo.commits) == 1


def test_push_sharded_to_a_branch_of_a_private_repo(hub, tmp_path):
    folder = write_merged_folder(tmp_path, max_shard_size=100_000, careless=False)
    assert json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    (folder / ".README.md.x1y2.tmp").write_text("left by an interrupted write")  # never uploaded
    url = push_folder_to_hub(
        folder,
        "my-org/sharded",
        private=True,
        revision="pma-merged",
        commit_message="PMA merge of 6",
        token=TOKEN,
        endpoint=hub.url,
    )
    repo = hub.repos["my-org/sharded"]
    assert repo.private
    assert hub.files("my-org/sharded", "main") == {}  # the branch, not main, got the files
    received = hub.files("my-org/sharded", "pma-merged")
    local = _local_files(folder)
    assert received == {name: data for name, data in local.items() if not name.endswith(".tmp")} != local
    assert len([n for n in received if n.endswith(".safetensors")]) > 1
    assert repo.commits[-1]["summary"] == "PMA merge of 6" and url.endswith(repo.heads["pma-merged"])


def test_bare_name_goes_to_the_token_owner_and_the_card_says_so(hub, merged):
    push_folder_to_hub(merged, "tiny-pma", token=TOKEN, endpoint=hub.url)
    received = hub.files("tester/tiny-pma")  # the test Hub's user
    assert re.search(r"""from_pretrained\(["']tester/tiny-pma["']\)""", received["README.md"].decode())


def test_cli_push_uses_hf_token_and_hf_endpoint(hub, merged):
    env = online_cli_env(hub, TOKEN, str(merged.parent / "hf-home"))
    proc = run_cli(
        "push",
        merged,
        "--repo-id",
        "cli-org/model",
        "--commit-message",
        "from the CLI",
        env=env,
        process=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    repo = hub.repos["cli-org/model"]
    assert proc.stdout.strip() == f"{hub.url}/cli-org/model/commit/{repo.heads['main']}"
    assert hub.files("cli-org/model") == _local_files(merged)
    assert repo.commits[-1]["summary"] == "from the CLI"


def test_no_token_is_a_clear_error_before_any_request(hub, merged, capsys):
    with pytest.raises(HubAuthError, match=r"HF_TOKEN.*hf auth login"):
        push_folder_to_hub(merged, "my-org/tiny-pma", endpoint=hub.url)
    assert hub.requests == []
    assert main(["push", str(merged), "--repo-id", "my-org/tiny-pma"]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face token" in err and "HF_TOKEN" in err
    assert hub.requests == []


def test_offline_mode_is_a_clear_error(hub, merged, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        push_folder_to_hub(merged, "my-org/tiny-pma", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize("repo_id", ["not a repo", "a/b/c", "org/--name", "org/name.", ""])
def test_invalid_repo_id_uploads_nothing(hub, merged, repo_id):
    with pytest.raises(ValueError, match="invalid repo id"):
        push_folder_to_hub(merged, repo_id, token=TOKEN, endpoint=hub.url)
    assert hub.requests == [] and hub.repos == {}
    assert not (merged / "README.md").exists()  # not even the card was written


def test_wrong_token_is_401(hub, merged):
    with pytest.raises(HubAuthError, match=r"rejected the token \(HTTP 401\).*HF_TOKEN"):
        push_folder_to_hub(
            merged, "my-org/tiny-pma", token="hf_wrong_token_for_the_local_hub", endpoint=hub.url
        )
    assert hub.uploads() == [] and hub.repos == {}


def test_no_write_access_is_403_and_uploads_nothing(hub, merged, capsys):
    hub.fail_status, hub.fail_on = 403, {"preupload", "commit"}
    with pytest.raises(HubAuthError, match=r"refused to write to my-org/tiny-pma \(HTTP 403\)"):
        push_folder_to_hub(merged, "my-org/tiny-pma", token=TOKEN, endpoint=hub.url)
    assert hub.files("my-org/tiny-pma") == {}
    kinds = [r["kind"] for r in hub.requests]
    assert "preupload" in kinds and "commit" not in kinds  # refused at the first upload request

    hub.fail_on = None  # now every request, repo creation included, is refused
    with pytest.raises(HubAuthError, match="HTTP 403"):
        push_folder_to_hub(merged, "my-org/other", token=TOKEN, endpoint=hub.url)
    assert "my-org/other" not in hub.repos


@pytest.mark.parametrize("damage", ["no config", "no weights", "missing shard", "truncated"])
def test_incomplete_folder_uploads_nothing(hub, tmp_path, damage):
    folder = write_merged_folder(
        tmp_path, max_shard_size=100_000 if damage == "missing shard" else "5GB", careless=False
    )
    if damage == "no config":
        (folder / "config.json").unlink()
        match = "config.json is missing"
    elif damage == "no weights":
        (folder / "model.safetensors").unlink()
        match = "no weights"
    elif damage == "missing shard":
        shard = sorted(folder.glob("model-*.safetensors"))[-1]
        shard.unlink()
        match = f"missing shard.*{shard.name}"
    else:
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
        match = r"model.safetensors is not a valid safetensors file: .*\(truncated\)"
    with pytest.raises(ValueError, match=match):
        push_folder_to_hub(folder, "my-org/broken", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []
    with pytest.raises(ValueError, match=match):
        check_model_folder(folder)


def test_records_with_a_token_are_not_pushed(hub, tmp_path):
    folder = write_merged_folder(tmp_path, careless=True)
    assert FAKE_TOKEN in (folder / "pma_training.json").read_text()
    with pytest.raises(ValueError, match="pma_training.json.*access token"):
        push_folder_to_hub(folder, "my-org/leaky", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []
