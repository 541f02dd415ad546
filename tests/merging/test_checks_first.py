"""Every check runs before the first byte is merged or downloaded: strategy arguments before any
Hub request, a missing ``config.json`` before any tensor, a local-looking path that does not exist
at once (no Hub lookup), and a failing Hub in one line. Real processes against the local Hub
stand-in (``tests/helpers/hub_server.py``)."""

from __future__ import annotations

import pytest

from hf_pma.merging.engine import merge_checkpoints
from tests.helpers.cli import run_cli
from tests.helpers.data import sample_text
from tests.helpers.hub_server import HubServer
from tests.helpers.models import make_tiny_model, save_model_folder

REPO = "org/tiny"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hubsrc")
    make_tiny_model(seed=0).save_pretrained(folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    with HubServer() as server:
        server.add_repo(REPO)
        for step in (1000, 2000, 3000):
            server.commit_files(REPO, f"step{step}", files)
        yield server


@pytest.fixture()
def fresh(hub):
    hub.requests.clear()
    hub.fail_status = None
    yield hub
    hub.fail_status = None


def _cli(args, endpoint, tmp_path, cwd=None):
    """``hf-pma ARGS`` as a process of its own: ``HF_ENDPOINT`` is read when huggingface_hub is imported."""
    env = dict(
        HF_HUB_OFFLINE=None,
        TRANSFORMERS_OFFLINE=None,
        HF_TOKEN=None,
        HF_ENDPOINT=endpoint,
        NO_PROXY="127.0.0.1,localhost",
        HF_HOME=str(tmp_path / "hf-home"),
        OMP_NUM_THREADS="1",
    )
    return run_cli(*args, env=env, cwd=cwd, process=True)


def _error_line(proc, command):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"hf-pma {command}: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def _gone_hub_url() -> str:
    """The address of a Hub stand-in that has stopped: nothing answers there."""
    with HubServer() as gone:
        return gone.url


def test_ema_alpha_is_refused_before_any_hub_request(fresh, tmp_path):
    proc = _cli(
        ["merge", REPO, "--revisions", "step*", "--strategy", "ema", "--alpha", "1.5", "-o", tmp_path / "m"],
        fresh.url,
        tmp_path,
    )
    assert "EMA alpha must be in (0, 1], got 1.5" in _error_line(proc, "merge")
    assert fresh.requests == [] and not (tmp_path / "hf-home").exists()
    # the library call too: nothing listed, nothing downloaded
    with pytest.raises(ValueError, match="EMA alpha"):
        merge_checkpoints(
            [f"{REPO}@step1000", f"{REPO}@step2000"], tmp_path / "m2", strategy="ema", alpha=0.0
        )
    with pytest.raises(ValueError, match="negative"):
        merge_checkpoints([f"{REPO}@step1000", f"{REPO}@step2000"], tmp_path / "m3", weights=[1, -1])
    assert fresh.requests == []


def test_a_source_without_config_is_found_before_any_tensor_is_merged(tmp_path, fresh):
    old = save_model_folder(tmp_path / "old", make_tiny_model(seed=0))
    new = save_model_folder(tmp_path / "new", make_tiny_model(seed=1))
    (new / "config.json").unlink()
    proc = _cli(["merge", old, new, "-o", tmp_path / "m"], fresh.url, tmp_path)
    assert f"{new} has no config.json" in _error_line(proc, "merge")
    assert "Merging 2 checkpoints" not in proc.stderr  # stopped before the merge began
    assert not [
        p.name for p in tmp_path.iterdir() if p.name.startswith((".m", "m"))
    ]  # no output, no temporary


@pytest.mark.parametrize("command", ["eval", "merge"])
@pytest.mark.parametrize(
    "name",
    ["./missing", "../missing", "~/surely-missing-hf-pma", "/nonexistent/model", "a/b/c", "run/missing"],
)
def test_a_local_looking_path_that_does_not_exist_is_one_line_without_the_hub(fresh, tmp_path, command, name):
    (tmp_path / "run").mkdir()  # "run/missing" exists partially: a local path, not org/name
    text = tmp_path / "heldout.txt"
    text.write_text(sample_text(2000))
    args = ["eval", name, "--eval-file", text] if command == "eval" else ["merge", name, "-o", tmp_path / "m"]
    line = _error_line(_cli(args, fresh.url, tmp_path, cwd=tmp_path), command)
    assert name in line and "does not exist" in line
    assert fresh.requests == []


def test_an_unknown_hub_name_is_one_request_and_one_line(fresh, tmp_path):
    text = tmp_path / "heldout.txt"
    text.write_text(sample_text(2000))
    line = _error_line(_cli(["eval", "doesnotexist", "--eval-file", text], fresh.url, tmp_path), "eval")
    assert f"doesnotexist is neither a local folder nor a model on the Hub at {fresh.url}" in line
    # one look-up of the model (huggingface_hub may add a request of its own, not about models)
    assert [r["path"] for r in fresh.requests if "models" in r["path"] or r["kind"] == "resolve"] == [
        "/api/models/doesnotexist"
    ]
    # no Hub to reach: one line at once, not a loader's retries
    closed = _gone_hub_url()
    line = _error_line(_cli(["eval", "doesnotexist", "--eval-file", text], closed, tmp_path), "eval")
    assert f"doesnotexist is not a local folder, and the Hub at {closed} cannot be reached" in line
    assert "Retrying" not in line


@pytest.mark.parametrize("status", [500, 502])
def test_a_hub_answering_5xx_is_one_line_without_verbose(fresh, tmp_path, status):
    text = tmp_path / "heldout.txt"
    text.write_text(sample_text(2000))
    fresh.fail_status = status
    line = _error_line(_cli(["eval", REPO, "--eval-file", text], fresh.url, tmp_path), "eval")
    assert f"answered HTTP {status}" in line and REPO in line
    line = _error_line(
        _cli(["merge", f"{REPO}@step1000", f"{REPO}@step2000", "-o", tmp_path / "m"], fresh.url, tmp_path),
        "merge",
    )
    assert str(status) in line and REPO in line


@pytest.mark.parametrize("revision", ["../../x", "refs/pr/../../x", "a..b"])
def test_a_bad_revision_name_is_refused_before_any_request(fresh, tmp_path, revision):
    proc = _cli(
        ["merge", f"{REPO}@{revision}", f"{REPO}@step1000", "-o", tmp_path / "m"], fresh.url, tmp_path
    )
    assert f"invalid revision of {REPO}@{revision} '{revision}'" in _error_line(proc, "merge")
    assert fresh.requests == []
