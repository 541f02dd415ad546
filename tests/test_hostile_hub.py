"""A Hub that answers as an attacker would: its answers are input, checked before they are used.

The local Hub stand-in (``tests/helpers/hub_server.py``) serves, per repo, one hostile answer each: a
commit id shaped like a path, an ETag shaped like a path, a file name holding a terminal escape,
a body that never ends, a file whose bytes are not the ones its metadata hashes, branch names
holding a terminal escape or a right-to-left override, and a server that accepts the
connection and never answers. Each class goes through the real commands (``hf-pma merge
org/model@REV`` / ``--revisions``, ``hf-pma eval org/model``), as processes of their own
(``HF_ENDPOINT`` is read at import); the commands of one fixture share one process. After
each, nothing was written outside the cache and output folders.
"""

from __future__ import annotations

import json

import pytest

from hf_pma.utils.hub_client import HUB_TIMEOUT_ENV, hub_timeouts, parse_hub_timeout, set_hub_timeout
from tests.helpers.cli import run_cli_in_one_process
from tests.helpers.data import local_model, sample_text
from tests.helpers.hub_server import BOMB_INFLATED, DRIP_BYTES, ENDLESS_CAP, HubServer, gzip_bomb

PWNED = "../../../PWNED"
REFS_GOOD = ("step100", "step200")
REFS_BAD = ("step300\x1b[2J\x1b]0;owned\x07", "step\u202e004")
BAD_NAME = "modeling_\x1b]0;owned\x07.py"
# Answers bounded in total: one byte every DRIP_S seconds (body, or headers), redirects to itself
# each a little under the timeout, a gzip bomb, an answer that announces 512 MiB.
BOUNDED = ("drip", "drip_headers", "redirects", "bomb", "huge")


def _tree(root):
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _error_line(result, command):
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith(f"hf-pma {command}: ")]
    assert result.returncode == 2 and lines, (result.returncode, result.stderr[-3000:])
    return lines[-1]


@pytest.fixture(scope="module")
def server(model_files):
    with HubServer() as hub:
        for name in ("commit", "etag", "names", "endless", "sha", "silent", *BOUNDED):
            repo = f"evil/{name}-model"
            hub.add_repo(repo)
            files = dict(model_files, **({BAD_NAME: b"print('hi')\n"} if name == "names" else {}))
            hub.commit_files(repo, "main", files)
            hub.set_branch(repo, "step300", "main")
        hub.hostile = {
            "evil/commit-model": {"commit": f"{PWNED}_sha"},
            "evil/etag-model": {"etag": f"{PWNED}_etag"},
            "evil/endless-model": {"endless": True},
            "evil/sha-model": {"served": {"model.safetensors": _tampered(model_files["model.safetensors"])}},
            "evil/silent-model": {"silent": True},
            **{f"evil/{name}-model": {name: True} for name in BOUNDED},
        }
        hub.add_repo("evil/branches-model")
        for i, name in enumerate(REFS_GOOD + REFS_BAD):
            hub.commit_files("evil/branches-model", name, model_files, message=str(i))
        yield hub


def _tampered(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])  # same size, another sha256


def _env(hub, root):
    return {
        "HF_HUB_OFFLINE": None,
        "TRANSFORMERS_OFFLINE": None,
        "HF_TOKEN": None,
        HUB_TIMEOUT_ENV: None,
        "HF_ENDPOINT": hub.url,
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HOME": str(root / "hf-home"),
    }


@pytest.fixture(scope="module")
def merges(server, tmp_path_factory):
    """``hf-pma merge`` of one revision of each hostile repo, and of the refs matching ``step*``."""
    root = tmp_path_factory.mktemp("merges")
    cache = root / "cache"
    before = _tree(root)
    names = ("commit", "etag", "names", "endless", "sha")
    commands = [
        ["merge", f"evil/{n}-model@step300", "-o", root / "out" / n, "--cache-dir", cache, "-q"]
        for n in names
    ]
    commands.append(
        [
            "merge",
            "evil/branches-model",
            "--revisions",
            "step*",
            "--last",
            "all",  # every good revision is merged (and recorded)
            "-o",
            root / "out" / "branches",
            "--cache-dir",
            cache,
        ]
    )
    commands.append(
        ["merge", "evil/commit-model", "--revisions", "step*", "-o", root / "out" / "c", "--cache-dir", cache]
    )
    results = run_cli_in_one_process(*commands, env=_env(server, root), timeout=120)
    written = _tree(root) - before
    return {
        "results": dict(zip([*names, "refs", "commit-refs"], results)),
        "outside": sorted(p for p in written if not p.startswith(("cache", "out"))),
        "cache": cache,
        "root": root,
    }


@pytest.fixture(scope="module")
def evals_and_silence(server, tmp_path_factory):
    """``hf-pma eval org/model`` of the hostile repos, then a merge and an eval of the silent one
    with ``--hub-timeout 1`` (last: the flag holds for the rest of the process)."""
    root = tmp_path_factory.mktemp("evals")
    text = root / "heldout.txt"
    text.write_text(sample_text(2000))
    before = _tree(root)
    common = ["--eval-file", text, "--block-size", "32", "-q"]
    results = run_cli_in_one_process(
        ["eval", "evil/commit-model", "-o", root / "commit.json", *common],
        ["eval", "evil/etag-model", "-o", root / "etag.json", *common],
        [
            "merge",
            "evil/silent-model@step300",
            "-o",
            root / "m",
            "--cache-dir",
            root / "cache",
            "--hub-timeout",
            "1",
        ],
        ["eval", "evil/silent-model", "-o", root / "silent.json", "--hub-timeout", "1", *common],
        env=_env(server, root),
        timeout=120,
    )
    written = _tree(root) - before
    return {
        "results": dict(zip(["commit", "etag", "merge-silent", "eval-silent"], results)),
        "outside": sorted(
            p for p in written if p != "hf-home" and not p.startswith(("hf-home/hub", "cache"))
        ),
        "root": root,
    }


# ---------------------------------------------------------------- answers used as paths


def test_a_commit_id_shaped_like_a_path_is_refused_before_any_download(merges, evals_and_silence, server):
    line = _error_line(merges["results"]["commit"], "merge")
    assert "the Hub answered the commit id '../../../PWNED_sha', which is not 40 hex characters" in line
    assert "evil/commit-model@step300" in line
    line = _error_line(merges["results"]["commit-refs"], "merge")  # a branch's target commit, from the refs
    assert "evil/commit-model@" in line and "the Hub answered the commit id '../../../PWNED_sha'" in line
    line = _error_line(evals_and_silence["results"]["commit"], "eval")
    assert "the Hub answered the commit id '../../../PWNED_sha'" in line
    assert not any(
        r["kind"] == "resolve" and r["file"].startswith("evil/commit-model/") for r in server.requests
    )
    assert merges["outside"] == [] and evals_and_silence["outside"] == []
    assert not (merges["root"] / "out" / "commit").exists()


def test_an_etag_shaped_like_a_path_is_refused(merges, evals_and_silence):
    for result, command in (
        (merges["results"]["etag"], "merge"),
        (evals_and_silence["results"]["etag"], "eval"),
    ):
        line = _error_line(result, command)
        assert "downloading config.json of evil/etag-model@" in line
        assert "the Hub answered the content hash '../../../PWNED_etag', which is no sha1 or sha256" in line
    assert merges["outside"] == [] and evals_and_silence["outside"] == []
    assert not any("PWNED" in p for p in _tree(merges["root"]) | _tree(evals_and_silence["root"]))
    for repo in (merges["cache"], evals_and_silence["root"] / "hf-home" / "hub"):
        kept = [p.name for p in (repo / "models--evil--etag-model").rglob("*") if p.is_file()]
        assert [name for name in kept if not name.endswith(".lock")] == []  # not even a partial file


def test_a_file_name_holding_a_terminal_escape_is_refused_escaped(merges, server):
    result = merges["results"]["names"]
    line = _error_line(result, "merge")
    assert (
        "the Hub answered the file name 'modeling_\\x1b]0;owned\\x07.py', which is not a plain file name"
        in line
    )
    assert "\x1b" not in result.stderr + result.stdout
    assert not any(
        r["kind"] == "resolve" and r["file"].startswith("evil/names-model/") for r in server.requests
    )
    assert not (merges["cache"] / "models--evil--names-model").exists()


# ---------------------------------------------------------------- bodies


def test_a_body_that_never_ends_stops_at_the_announced_size(merges, server, model_files):
    line = _error_line(merges["results"]["endless"], "merge")
    size = len(model_files["config.json"])
    assert (
        f"downloading config.json of evil/endless-model@step300: the Hub at {server.url} sent more than {size:,} bytes"
        in line
    )
    assert 0 < server.sent[("evil/endless-model", "config.json")] < ENDLESS_CAP // 2  # the client hung up
    left = [p for p in (merges["cache"] / "models--evil--endless-model").rglob("*") if p.is_file()]
    assert [p.name for p in left if not p.name.endswith(".lock")] == []


def test_a_file_that_does_not_match_its_sha256_leaves_nothing_in_the_cache(merges, model_files):
    import hashlib

    line = _error_line(merges["results"]["sha"], "merge")
    announced = hashlib.sha256(model_files["model.safetensors"]).hexdigest()
    assert (
        "downloading model.safetensors of evil/sha-model@step300: its content does not match the sha256"
        in line
    )
    assert announced in line
    repo = merges["cache"] / "models--evil--sha-model"
    assert not (repo / "blobs" / announced).exists()
    assert not list(repo.rglob("*.incomplete"))
    assert not list((repo / "snapshots").glob("*/model.safetensors"))
    assert not (merges["root"] / "out" / "sha").exists()


# ---------------------------------------------------------------- names shown and stored


def test_ref_names_holding_escapes_are_left_out_escaped_and_never_recorded(merges):
    result = merges["results"]["refs"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\x1b" not in result.stderr + result.stdout and "\u202e" not in result.stderr + result.stdout
    assert "left out 2 branch(es) or tag(s)" in result.stderr and "\\u202e" in result.stderr
    record = json.loads((merges["root"] / "out" / "branches" / "pma_merge.json").read_text())

    def strings(value):
        if isinstance(value, dict):
            return [s for k, v in value.items() for s in [k, *strings(v)]]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []

    assert all(s.isprintable() for s in strings(record))
    text = json.dumps(record)
    assert all(name in text for name in REFS_GOOD)


# ---------------------------------------------------------------- a Hub that never answers


def test_a_hub_that_never_answers_is_one_line_after_the_timeout(evals_and_silence, server):
    results = evals_and_silence["results"]
    line = _error_line(results["merge-silent"], "merge")
    assert (
        f"cannot read revision step300 of evil/silent-model: the Hub at {server.url} did not answer within 1 s"
        in line
    )
    line = _error_line(results["eval-silent"], "eval")
    assert (
        f"evil/silent-model is not a local folder, and the Hub at {server.url} did not answer within 1 s"
        in line
    )
    assert evals_and_silence["outside"] == []


def test_the_timeouts_come_from_the_flag_the_environment_or_the_defaults(monkeypatch):
    monkeypatch.delenv(HUB_TIMEOUT_ENV, raising=False)
    try:
        assert set_hub_timeout(None) == (10.0, 60.0)
        monkeypatch.setenv(HUB_TIMEOUT_ENV, "5,120")
        assert hub_timeouts() == (5.0, 120.0)
        assert set_hub_timeout("2") == (2.0, 2.0)  # the flag wins over the environment
        for bad in ("0", "-1", "nan", "1,2,3", "soon", ""):
            with pytest.raises(ValueError, match="is not a timeout"):
                parse_hub_timeout(bad)
    finally:
        set_hub_timeout(None)


def test_a_revision_holding_a_bidi_override_is_refused_before_any_request(tmp_path):
    from tests.helpers.cli import run_cli

    result = run_cli("merge", "org/model@step\u202e0003", "-o", tmp_path / "m")
    line = _error_line(result, "merge")
    assert "invalid revision of org/model@step\\u202e0003" in line and "bidi override" in line
    assert "\u202e" not in result.stderr


# ---------------------------------------------------------------- answers bounded in total


@pytest.fixture(scope="module")
def bounded(server, model_files, tmp_path_factory):
    """``hf-pma merge`` of each repo whose API answers drip, inflate or never end, with
    ``HF_PMA_HUB_TIMEOUT=2``; and ``hf-pma eval`` of a local model with the tokenizer of the repo
    whose file bodies never end (downloaded by transformers)."""
    root = tmp_path_factory.mktemp("bounded")
    model, text = local_model(root, model_files)
    gzip_bomb()  # made before the clock of any answer starts
    before = _tree(root)
    # The bounds in size are met long before any deadline: 30 s for those (the flag holds for the
    # rest of the process, so they come after the dripping answers, which keep 2 s).
    commands = [
        ["merge", f"evil/{name}-model@step300", "-o", root / "out" / name, "--cache-dir", root / "cache", "-q"]
        + (["--hub-timeout", "30"] if name in ("bomb", "huge") else [])
        for name in BOUNDED
    ]
    commands.append(
        ["eval", model, "--tokenizer", "evil/endless-model", "--eval-file", text, "--block-size", "32", "-o", root / "tok.json", "-q"]
    )
    results = run_cli_in_one_process(*commands, env={**_env(server, root), HUB_TIMEOUT_ENV: "2"}, timeout=300)
    written = _tree(root) - before
    return {
        "results": dict(zip([*BOUNDED, "tokenizer"], results)),
        "outside": sorted(p for p in written if not p.startswith(("cache", "hf-home"))),
    }


@pytest.mark.parametrize("name", ["drip", "drip_headers"])
def test_an_answer_sent_one_byte_at_a_time_ends_at_the_deadline(bounded, server, name):
    line = _error_line(bounded["results"][name], "merge")
    assert f"the Hub at {server.url} did not answer within 2 s" in line, line
    # The deadline is the whole answer's, not a gap between reads: a few bytes, not the answer.
    assert 0 < server.sent[(f"evil/{name}-model", "api")] < DRIP_BYTES // 100
    assert bounded["outside"] == []


def test_redirects_share_their_requests_deadline(bounded, server):
    line = _error_line(bounded["results"]["redirects"], "merge")
    assert f"the Hub at {server.url} did not answer within 2 s" in line, line
    assert server.sent[("evil/redirects-model", "api")] <= 3  # 0.9 s each: not 20 hops (18 s)


@pytest.mark.parametrize("name", ["bomb", "huge"])
def test_an_answer_larger_than_its_bound_after_decompression_is_refused(bounded, server, name):
    line = _error_line(bounded["results"][name], "merge")
    assert f"the Hub at {server.url} sent more than 67,108,864 bytes for /api/models/evil/{name}-model" in line, line
    assert "after decompression" in line
    if name == "huge":  # the client hung up long before the end
        assert server.sent[(f"evil/{name}-model", "api")] < BOMB_INFLATED // 4


def test_a_download_through_transformers_stops_at_the_size_the_hub_announced(bounded, server, model_files):
    line = _error_line(bounded["results"]["tokenizer"], "eval")
    assert "sent more than" in line and "evil/endless-model" in line, line
    sent = {path: n for (repo, path), n in server.sent.items() if repo == "evil/endless-model" and path != "api"}
    assert sent and all(n < ENDLESS_CAP // 2 for n in sent.values()), sent
    assert not (bounded["outside"] and "tok.json" in bounded["outside"])
