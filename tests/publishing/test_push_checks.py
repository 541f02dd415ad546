"""What ``hf-pma push`` checks before its first request: no file holds the token it would use
(whatever its shape), the revision is a valid ref name; and a Hub failure is one line."""

from __future__ import annotations

import json

import pytest

from hf_pma.publishing.hub import push_folder_to_hub
from tests.hub_server import online_cli_env, online_hub
from tests.pma_records import write_merged_folder
from tests.testing_utils import run_cli

# Not shaped like a Hugging Face token: only its value gives it away.
PLAIN_TOKEN = "plain-secret-value-0123456789"


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    with online_hub(monkeypatch, tmp_path, (PLAIN_TOKEN,)) as server:
        yield server


@pytest.fixture()
def merged(tmp_path, tiny_tokenizer):
    return write_merged_folder(tmp_path, tiny_tokenizer, careless=False)


def _push_cli(hub, folder, *args):
    # A process of its own: HF_ENDPOINT is read when huggingface_hub is imported.
    env = online_cli_env(hub, PLAIN_TOKEN, str(folder.parent / "hf-home"))
    return run_cli("push", folder, "--repo-id", "my-org/model", *args, env=env, process=True, timeout=120)


@pytest.mark.parametrize("where", ["notes.txt", "logs/run.log", "config.json"])
def test_a_folder_holding_the_token_in_use_is_not_pushed(hub, merged, where):
    path = merged / where
    path.parent.mkdir(exist_ok=True)
    if where == "config.json":  # a field of a file the model needs
        path.write_text(
            json.dumps({**json.loads(path.read_text()), "_comment": f"pushed with {PLAIN_TOKEN}"})
        )
    else:
        path.write_text(f"export SOMETHING={PLAIN_TOKEN}\n")
    with pytest.raises(ValueError, match=rf"{where} in merged contains the access token this push would use"):
        push_folder_to_hub(merged, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    proc = _push_cli(hub, merged)
    assert (
        proc.returncode == 2 and "contains the access token" in proc.stderr and "Traceback" not in proc.stderr
    )
    assert PLAIN_TOKEN not in proc.stderr + proc.stdout
    assert hub.requests == [] and hub.repos == {}


def test_the_token_split_across_read_chunks_is_found(hub, merged, monkeypatch):
    import hf_pma.publishing.hub as hub_module

    monkeypatch.setattr(hub_module, "_SCAN_CHUNK_BYTES", 16)
    (merged / "blob.bin").write_bytes(b"x" * 13 + PLAIN_TOKEN.encode() + b"y" * 40)
    with pytest.raises(ValueError, match="blob.bin in merged contains the access token"):
        push_folder_to_hub(merged, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize(
    "revision",
    ["../../x", "refs/pr/../../x", "refs/pr/x", "a..b", ".hidden", "x.lock", "a b", "br~1", "@", "a//b"],
)
def test_invalid_revision_names_are_refused_before_any_request(hub, merged, revision):
    with pytest.raises(ValueError, match=rf"invalid revision '{revision.replace('.', '[.]')}'"):
        push_folder_to_hub(merged, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url, revision=revision)
    assert hub.requests == []


def test_cli_push_revision_dot_dot_is_refused(hub, merged):
    proc = _push_cli(hub, merged, "--revision", "../../x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "hf-pma push: error: invalid revision '../../x'" in proc.stderr
    assert hub.requests == [] and hub.repos == {}
    # A valid branch and a pull-request ref still go through.
    ok = _push_cli(hub, merged, "--revision", "pma-merged")
    assert ok.returncode == 0, ok.stderr
    assert "pma-merged" in hub.repos["my-org/model"].branches


@pytest.mark.parametrize("status", [500, 503])
def test_a_failing_hub_is_one_line_without_verbose(hub, merged, status):
    hub.fail_status = status
    proc = _push_cli(hub, merged)
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        len(lines) == 1 and lines[0].startswith("hf-pma push: error: the Hub at") and str(status) in lines[0]
    )
