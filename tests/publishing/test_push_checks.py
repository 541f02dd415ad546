"""What ``hf-pma push`` checks before its first request: no file holds the token it would use
(whatever its shape), the revision is a valid ref name; and a Hub failure is one line."""

from __future__ import annotations

import json
import os
import re

import pytest

from hf_pma.publishing.hub import push_folder_to_hub
from tests.helpers.cli import run_cli
from tests.helpers.hub_server import online_cli_env, online_hub
from tests.helpers.pma_records import write_merged_folder

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


# ---------------------------------------------------------------- what the folder holds


def _hostile_entry(folder, kind, outside):
    """Plant one thing in ``folder`` that must stop a push before any request."""
    if kind == "link-to-etc-passwd":
        (folder / "notes.txt").symlink_to("/etc/passwd")
    elif kind in ("link-to-cached-login", "link-to-stored-tokens"):
        name = "token" if kind == "link-to-cached-login" else "stored_tokens"
        login = outside / "hf-home" / name  # where `hf auth login` caches a login: not the token in use
        login.parent.mkdir(exist_ok=True)
        login.write_text("hf_someOtherLoginNotTheOneInUse0000000\n")
        (folder / "extras").mkdir()
        (folder / "extras" / name).symlink_to(login)
    elif kind == "link-to-a-folder-outside":
        (outside / "private").mkdir()
        (outside / "private" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
        (folder / "more").symlink_to(outside / "private")
    elif kind == "dangling-link":
        (folder / "gone.json").symlink_to(outside / "nothing-here")
    elif kind == "fifo":
        os.mkfifo(folder / "pipe")
    elif kind == "link-as-config":  # a file the model needs, linked out
        (outside / "config.json").write_bytes((folder / "config.json").read_bytes())
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(outside / "config.json")


HOSTILE_ENTRIES = [
    ("link-to-etc-passwd", "notes.txt is a symbolic link to outside the folder"),
    ("link-to-cached-login", "extras/token is a symbolic link to outside the folder"),
    ("link-to-stored-tokens", "extras/stored_tokens is a symbolic link to outside the folder"),
    ("link-to-a-folder-outside", "more is a symbolic link to outside the folder"),
    ("dangling-link", "gone.json is a symbolic link to nothing"),
    ("fifo", "pipe is not a regular file (a FIFO)"),
    ("link-as-config", "config.json is a symbolic link to outside the folder"),
]


@pytest.mark.parametrize("kind, message", HOSTILE_ENTRIES, ids=[k for k, _ in HOSTILE_ENTRIES])
def test_a_folder_with_a_link_out_or_a_special_file_is_refused_before_any_request(
    hub, merged, tmp_path, kind, message
):
    _hostile_entry(merged, kind, tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        push_folder_to_hub(merged, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    assert "\n" not in str(caught.value)
    assert hub.requests == [] and hub.repos == {}
    assert not (merged / "README.md").exists()  # nothing written into the folder either


def test_cli_push_of_a_folder_with_a_link_out_is_one_line_and_no_request(hub, merged, tmp_path):
    _hostile_entry(merged, "link-to-cached-login", tmp_path)
    proc = _push_cli(hub, merged)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [line for line in errors if line.startswith("hf-pma push: error: ")] and len(errors) == 1
    assert "extras/token is a symbolic link to outside the folder" in errors[0]
    assert "hf_someOtherLogin" not in proc.stderr + proc.stdout
    assert hub.requests == [] and hub.repos == {}


def test_links_inside_the_folder_upload_the_files_they_name_and_nothing_else(hub, merged):
    (merged / "alias-config.json").symlink_to("config.json")  # a link to a file inside
    (merged / "docs").mkdir()
    (merged / "docs" / "notes.md").write_text("notes\n")
    (merged / "docs-again").symlink_to("docs")  # a link to a folder inside: walked once, under its name
    (merged / ".git").mkdir()
    (merged / ".git" / "config").write_text("[core]\n")  # never uploaded
    (merged / ".README.md.x1y2.tmp").write_text("an interrupted write")  # never uploaded
    push_folder_to_hub(merged, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    received = hub.files("my-org/model")
    expected = {
        p.relative_to(merged).as_posix()
        for p in merged.rglob("*")
        if p.is_file() and not p.is_symlink() and ".git" not in p.parts and not p.name.endswith(".tmp")
    }
    assert "README.md" in expected and "docs/notes.md" in expected
    assert set(received) == expected | {"alias-config.json"}
    assert received["alias-config.json"] == (merged / "config.json").read_bytes()


# ---------------------------------------------------------------- the records and the card


def _edit_record(folder, name, change):
    path = folder / name
    if isinstance(change, str):  # raw text
        path.write_text(change)
        return
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _set(key, value, source=None):
    def change(data):
        (data["sources"][source] if source is not None else data)[key] = value

    return change


HOSTILE_RECORDS = [
    (
        "strategy-template",
        "pma_merge.json",
        _set("strategy", "{0.__class__.__mro__}"),
        "'strategy' should be",
    ),
    ("strategy-width", "pma_merge.json", _set("strategy", "{:200000000}"), "'strategy' should be"),
    ("created-1e300", "pma_merge.json", _set("created", 1e300), "['created'] should be a time in seconds"),
    ("tokens-10e400", "pma_merge.json", _set("tokens", 10**400, source=0), "is an integer of 401 digits"),
    ("weights-text", "pma_merge.json", _set("weights", "abc"), "['weights'] should be a list of numbers"),
    ("deep-merge", "pma_merge.json", "[" * 200_000 + "]" * 200_000, "nested deeper than"),
    (
        "truncated-merge",
        "pma_merge.json",
        '{"strategy": "sma", "sources": [',
        "pma_merge.json is not valid JSON",
    ),
    (
        "eval-text",
        "pma_eval.json",
        _set("results", {"PMA merge": {"lm": {"loss": "low"}}}),
        "not a number or null",
    ),
    ("history-text", "pma_training.json", _set("log_history", "x"), "'log_history' should be a list"),
]


@pytest.mark.parametrize("card", [False, True], ids=["without-card", "with-card"])
@pytest.mark.parametrize(
    "name, change, message", [r[1:] for r in HOSTILE_RECORDS], ids=[r[0] for r in HOSTILE_RECORDS]
)
def test_a_hostile_record_stops_the_push_before_any_request(hub, merged, name, change, message, card):
    if card:  # a card already there: the records are checked all the same
        (merged / "README.md").write_text("---\nlicense: mit\n---\n# a card\n")
    _edit_record(merged, name, change)
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        push_folder_to_hub(merged, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 600
    assert hub.requests == [] and hub.repos == {}
    assert (merged / "README.md").exists() == card


def test_cli_push_with_a_hostile_record_creates_no_repo(hub, merged):
    _edit_record(merged, "pma_merge.json", _set("strategy", "{0}"))
    proc = _push_cli(hub, merged)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "hf-pma push: error: " in proc.stderr and "'strategy' should be" in proc.stderr
    assert hub.requests == [] and hub.repos == {}


# ---------------------------------------------------------------- hf-pma card: the same checks


@pytest.mark.parametrize(
    "name, change, message",
    [
        r[1:]
        for r in HOSTILE_RECORDS
        if r[0] in ("strategy-template", "created-1e300", "tokens-10e400", "deep-merge")
    ],
    ids=["strategy-template", "created-1e300", "tokens-10e400", "deep-merge"],
)
def test_card_of_a_folder_with_a_hostile_record_is_one_line_and_writes_nothing(merged, name, change, message):
    _edit_record(merged, name, change)
    done = run_cli("card", merged)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("hf-pma card: error: ") and message in lines[0]
    assert not (merged / "README.md").exists() and not (merged / "pma_training.png").exists()


def test_card_in_a_read_only_folder_is_one_line_before_rendering(merged):
    from tests.helpers.mounts import read_only

    with read_only(merged):
        done = run_cli("card", merged)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"hf-pma card: error: cannot write the model card {merged / 'README.md'}" in done.stderr


def test_a_sharded_folder_is_refused_with_the_consolidate_command_then_pushed_consolidated(hub, tmp_path):
    """An online average or a snapshot of an FSDP / ZeRO-3 run is one file per rank, which
    transformers cannot load from the Hub: one line naming `hf-pma consolidate`, no request; the
    consolidated folder pushes."""
    from hf_pma.merging.consolidate import consolidate_snapshot
    from tests.helpers.models import make_tiny_model, save_model_folder
    from tests.helpers.sharded_files import LAYOUTS, write_sharded

    full = save_model_folder(tmp_path / "full", make_tiny_model())
    sharded = write_sharded(
        tmp_path / "online-sma", make_tiny_model().state_dict(), LAYOUTS["rows-2"], config_from=full
    )
    with pytest.raises(
        ValueError, match=r"online-sma is a sharded folder .*`hf-pma consolidate .*online-sma -o FULL`"
    ):
        push_folder_to_hub(sharded, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    proc = _push_cli(hub, sharded)
    assert (
        proc.returncode == 2
        and len(proc.stderr.strip().splitlines()) == 1
        and "hf-pma consolidate" in proc.stderr
    )
    assert hub.requests == [] and hub.repos == {}
    consolidated = consolidate_snapshot(sharded, tmp_path / "consolidated", progress=False)
    push_folder_to_hub(consolidated, "my-org/model", token=PLAIN_TOKEN, endpoint=hub.url)
    assert "model.safetensors" in hub.files("my-org/model")
