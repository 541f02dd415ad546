"""Merging a Hub repo's intermediate checkpoints by revision, against the local Hub stand-in.

The stand-in (``tests/helpers/hub_server.py``) serves, over real HTTP on 127.0.0.1, repos whose
branches and tags hold tiny models: Pythia-style names (``step1000`` ... ``step10000``, whose
alphabetical order is not their training order), OLMo-style names (``stage1-step150-tokens1B``)
and names without progress (``ckpt_002``). In-process calls take the endpoint as an argument
(``HF_ENDPOINT`` is read when ``huggingface_hub`` is imported); the CLI runs in a subprocess
with ``HF_ENDPOINT`` set, as a user would. ``HF_HUB_OFFLINE`` (set for the whole suite) would
block 127.0.0.1 too, so these tests lift it.
"""

from __future__ import annotations

import datetime
import json
import logging

import pytest
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file

from hf_pma.merging.engine import merge_checkpoints
from hf_pma.merging.hub_revisions import (
    HubRevisionError,
    NotEnoughDiskSpaceError,
    list_revisions,
    parse_progress,
    parse_token_count,
    revision_matcher,
)
from hf_pma.merging.sources import resolve_sources
from tests.helpers.cli import run_cli, run_cli_in_one_process
from tests.helpers.hub_server import HubServer
from tests.helpers.models import make_tiny_model
from tests.helpers.repo import REPO_ROOT

PYTHIA = "org/pythia-tiny"
OLMO = "org/olmo-tiny"
PLAIN = "org/llm360-tiny"
STEPS = [1000 * i for i in range(1, 11)]  # step1000 ... step10000: "step10000" sorts before "step2000"
OLMO_NAMES = [  # training order
    "stage1-step150-tokens1B",
    "stage1-step300-tokens2B",
    "stage1-step1500-tokens7B",
    "stage2-ingredient1-step50-tokens1B",
    "stage2-ingredient1-step100-tokens1B",
]
PLAIN_NAMES = {"ckpt_002": 3, "ckpt_010": 1, "ckpt_100": 2}  # name -> position by commit date
T0 = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)


def _folder_files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    """Ten local model folders (config, weights, tokenizer): the reference for every merge."""
    root = tmp_path_factory.mktemp("local")
    folders = []
    for i in range(10):
        folder = root / f"ckpt{i}"
        make_tiny_model(seed=i).save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
        folders.append(folder)
    return folders


@pytest.fixture(scope="module")
def server(checkpoints):
    with HubServer() as hub:
        hub.commits = {}
        hub.add_repo(PYTHIA)
        for i, step in enumerate(STEPS):
            oid = hub.commit_files(
                PYTHIA, f"step{step}", _folder_files(checkpoints[i]), date=T0 + datetime.timedelta(days=i)
            )
            hub.commits[f"step{step}"] = oid
        hub.set_branch(PYTHIA, "main", "step10000")  # as published runs do: main is the last checkpoint
        hub.add_tag(PYTHIA, "final", "step10000")
        hub.add_repo(OLMO)
        for i, name in enumerate(OLMO_NAMES):
            hub.commits[name] = hub.commit_files(
                OLMO, name, _folder_files(checkpoints[i]), date=T0 + datetime.timedelta(days=i)
            )
        hub.add_repo(PLAIN)
        for name, position in PLAIN_NAMES.items():
            files = _folder_files(checkpoints[position])
            hub.commits[name] = hub.commit_files(
                PLAIN, name, files, date=T0 + datetime.timedelta(days=position)
            )
        yield hub


@pytest.fixture()
def hub(server, monkeypatch, tmp_path):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    server.requests.clear()
    server.file_hook = None
    server.declared_sizes.clear()
    yield server
    server.file_hook = None


def _downloaded_revisions(hub):
    """Commit ids whose files were fetched (GET), in first-fetch order."""
    commits = []
    for r in hub.downloads():
        rev = r["file"].split("/")[2]
        if rev not in commits:
            commits.append(rev)
    return commits


def _weights_equal(a, b):
    return (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


# ---------------------------------------------------------------- names (pure)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("step143000", {"step": 143000, "tokens": None, "stage": None}),
        ("stage1-step150-tokens1B", {"step": 150, "tokens": 10**9, "stage": 1}),
        ("step1000-tokens4B", {"step": 1000, "tokens": 4 * 10**9, "stage": None}),
        ("stage2-ingredient3-step11931-tokens50B", {"step": 11931, "tokens": 50 * 10**9, "stage": 2}),
        ("step500-tokens2097M", {"step": 500, "tokens": 2097 * 10**6, "stage": None}),
        ("global_step20-tokens1.5T", {"step": 20, "tokens": 15 * 10**11, "stage": None}),
        ("main", {"step": None, "tokens": None, "stage": None}),
        ("restep3", {"step": None, "tokens": None, "stage": None}),
    ],
)
def test_progress_parsed_from_names(name, expected):
    assert parse_progress(name) == expected


def test_progress_from_a_user_regex_with_named_groups():
    regex, is_regex = revision_matcher(r"/^ckpt_(?P<step>\d+)(?:-(?P<tokens>\d+[KMBT]))?$/")
    assert is_regex
    assert parse_progress("ckpt_010-3M", regex) == {"step": 10, "tokens": 3 * 10**6, "stage": None}
    assert parse_progress("ckpt_100", regex) == {"step": 100, "tokens": None, "stage": None}
    assert parse_token_count("4194304") == 4194304 and parse_token_count("2.5k") == 2500
    with pytest.raises(ValueError, match="not a token count"):
        parse_token_count("4 billion")


def test_revision_patterns():
    glob, is_regex = revision_matcher("step1*")
    assert not is_regex and glob.fullmatch("step10000") and not glob.fullmatch("xstep1")
    for text in (r"/^step\d{4}$/", r"re:^step\d{4}$"):
        regex, is_regex = revision_matcher(text)
        assert is_regex and regex.search("step2000") and not regex.search("step10000")
    with pytest.raises(HubRevisionError, match=r"^revisions '/\(/' is not a valid regular expression") as info:
        revision_matcher("/(/")
    assert info.value.parameter == "revisions"  # the command shows it as --revisions


# ---------------------------------------------------------------- listing and order


def test_order_follows_parsed_progress_not_names(hub):
    revisions = list_revisions(PYTHIA, "*", endpoint=hub.url)
    # main and the tag "final" are step10000's commit: counted once, under the name with progress
    assert [r.name for r in revisions] == [f"step{s}" for s in STEPS]
    assert sorted(r.name for r in revisions) != [r.name for r in revisions]
    assert [r.commit for r in revisions] == [hub.commits[f"step{s}"] for s in STEPS]
    assert hub.downloads() == []  # listing reads no file

    olmo = list_revisions(OLMO, "stage*", endpoint=hub.url)
    assert [r.name for r in olmo] == OLMO_NAMES  # stage first: stage2 restarts its steps and tokens
    assert [(r.stage, r.step, r.tokens) for r in olmo][:2] == [(1, 150, 10**9), (1, 300, 2 * 10**9)]


def test_names_without_progress_are_ordered_by_commit_date(hub, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        revisions = list_revisions(PLAIN, "ckpt_*", endpoint=hub.url)
    assert [r.name for r in revisions] == sorted(
        PLAIN_NAMES, key=PLAIN_NAMES.get
    )  # ckpt_010, ckpt_100, ckpt_002
    assert "ordering the 3 revisions by commit date" in caplog.text
    # A regular expression with a named group orders them by their names instead.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_pma"):
        named = list_revisions(PLAIN, r"/^ckpt_(?P<step>\d+)$/", endpoint=hub.url)
    assert [r.name for r in named] == ["ckpt_002", "ckpt_010", "ckpt_100"] and [r.step for r in named] == [
        2,
        10,
        100,
    ]
    assert "commit date" not in caplog.text


# ---------------------------------------------------------------- merges


def test_revision_merge_equals_local_merge_bit_for_bit(hub, checkpoints, tmp_path):
    cache = tmp_path / "cache"
    sources = resolve_sources([PYTHIA], revisions="step*", last=4, cache_dir=cache, endpoint=hub.url)
    assert [s.name for s in sources] == ["step7000", "step8000", "step9000", "step10000"]
    assert [s.step for s in sources] == STEPS[-4:]
    # Only the four selected revisions were downloaded, and only what a merge needs.
    assert _downloaded_revisions(hub) == [hub.commits[s.name] for s in sources]
    fetched = {r["file"].split("/", 3)[3] for r in hub.downloads()}
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert all(str(s.path).startswith(str(cache)) for s in sources)

    from_hub = merge_checkpoints(sources, tmp_path / "from-hub", progress=False)
    local = merge_checkpoints(checkpoints[-4:], tmp_path / "local", progress=False)
    assert _weights_equal(from_hub, local)
    a, b = load_file(from_hub / "model.safetensors"), load_file(local / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    record = json.loads((from_hub / "pma_merge.json").read_text())
    assert record["base_model"] == PYTHIA
    assert [(s["repo_id"], s["revision"], s["commit"]) for s in record["sources"]] == [
        (PYTHIA, s.name, hub.commits[s.name]) for s in sources
    ]
    assert [s["path"] for s in record["sources"]] == [f"{PYTHIA}@{s.name}" for s in sources]
    assert [s["step"] for s in record["sources"]] == STEPS[-4:]


def test_explicit_revisions_by_branch_tag_and_commit(hub, checkpoints, tmp_path):
    commit = hub.commits["step2000"]
    given = [f"{PYTHIA}@final", f"{PYTHIA}@{commit}", f"{PYTHIA}@step1000"]  # out of order on purpose
    # The tag "final" and the commit carry no step in their names: ordered as given... unless
    # every name has one. Name them by branch to get the training order.
    sources = resolve_sources(
        [f"{PYTHIA}@step3000", f"{PYTHIA}@step1000", f"{PYTHIA}@step2000"],
        cache_dir=tmp_path / "c",
        endpoint=hub.url,
    )
    assert [s.name for s in sources] == ["step1000", "step2000", "step3000"]
    mixed = resolve_sources(given, cache_dir=tmp_path / "c", endpoint=hub.url)
    assert [s.record["commit"] for s in mixed] == [hub.commits["step10000"], commit, hub.commits["step1000"]]
    out = merge_checkpoints(mixed, tmp_path / "merged", progress=False)
    local = merge_checkpoints(
        [checkpoints[9], checkpoints[1], checkpoints[0]], tmp_path / "local", progress=False
    )
    assert _weights_equal(out, local)
    # The same commit named twice is refused.
    with pytest.raises(ValueError, match="given twice"):
        resolve_sources([f"{PYTHIA}@main", f"{PYTHIA}@step10000"], cache_dir=tmp_path / "c", endpoint=hub.url)


def test_last_and_every_pick_before_downloading(hub, tmp_path):
    sources = resolve_sources(
        [PYTHIA], revisions="step*", every=3, last=3, cache_dir=tmp_path / "c", endpoint=hub.url
    )
    # every 3rd counting back from the newest: 10000, 7000, 4000, 1000; then the newest 3
    assert [s.step for s in sources] == [4000, 7000, 10000]
    assert _downloaded_revisions(hub) == [hub.commits[f"step{s}"] for s in (4000, 7000, 10000)]
    regex = resolve_sources(
        [PYTHIA], revisions=r"/^step[1-3]000$/", cache_dir=tmp_path / "c", endpoint=hub.url
    )
    assert [s.name for s in regex] == ["step1000", "step2000", "step3000"]
    with pytest.raises(ValueError, match="found 3 sources .*, fewer than last=5"):
        resolve_sources(
            [PYTHIA], revisions=r"/^step[1-3]000$/", last=5, cache_dir=tmp_path / "c", endpoint=hub.url
        )


# ---------------------------------------------------------------- bad input


def test_missing_revision_and_empty_pattern_are_clear_errors(hub, tmp_path):
    with pytest.raises(
        HubRevisionError, match=r"revision 'step99' not found in org/pythia-tiny \(its branches and tags: "
    ):
        resolve_sources([f"{PYTHIA}@step99"], cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(
        HubRevisionError,
        match=r"^revisions 'final-\*' matches none of the 12 branches and tags of org/pythia-tiny",
    ):
        resolve_sources([PYTHIA], revisions="final-*", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(HubRevisionError, match="Hub repo org/nothing not found"):
        resolve_sources(["org/nothing"], revisions="*", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(ValueError, match="^revisions 'step\\*' applies to a Hub repo given as org/model"):
        resolve_sources([f"{PYTHIA}@step1000"], revisions="step*", cache_dir=tmp_path, endpoint=hub.url)
    assert hub.downloads() == [] and not any(tmp_path.rglob("*.safetensors"))


def test_disk_space_is_checked_before_the_first_byte(hub, tmp_path):
    hub.declared_sizes[(PYTHIA, "model.safetensors")] = 2**60  # the metadata says 1 EiB per revision
    cache = tmp_path / "cache"
    with pytest.raises(NotEnoughDiskSpaceError) as info:
        resolve_sources([PYTHIA], revisions="step*", last=2, cache_dir=cache, endpoint=hub.url)
    message = str(info.value)
    assert "downloading 2 revision(s) of org/pythia-tiny needs" in message and str(cache) in message
    needed = int(message.split(" bytes,")[0].rsplit("(", 1)[1])
    free = int(message.split(" bytes) is free")[0].rsplit("(", 1)[1])
    assert needed > 2 * 2**60 > free
    assert hub.downloads() == []
    assert not any(p.is_file() for p in cache.rglob("*"))


# ---------------------------------------------------------------- interrupted downloads


def test_a_dropped_connection_resumes_with_a_range_request(hub, checkpoints, tmp_path, monkeypatch):
    # huggingface_hub resumes from the last whole chunk it received (10 MB by default): smaller
    # chunks make a drop inside a tiny file resumable.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    dropped = []

    def drop_once(request):
        if request["file"].endswith("/model.safetensors") and request["method"] == "GET" and not dropped:
            dropped.append(request["file"])
            return ("drop", 20_000)
        return None

    hub.file_hook = drop_once
    sources = resolve_sources([f"{PYTHIA}@step5000"], cache_dir=tmp_path / "c", endpoint=hub.url)
    gets = [r for r in hub.downloads() if r["file"] == dropped[0]]
    assert len(gets) == 2 and gets[0]["range"] is None
    resumed_at = int(
        gets[1]["range"].removeprefix("bytes=").rstrip("-")
    )  # the second request asked for the rest only
    assert 0 < resumed_at <= 20_000
    assert _weights_equal(sources[0].path, checkpoints[4])


def test_a_failed_run_resumes_where_it_stopped(hub, checkpoints, tmp_path):
    broken = hub.commits["step9000"]

    def fail_step9000(request):
        return 403 if f"/{broken}/" in request["file"] else None  # a refusal is not retried: fast

    hub.file_hook = fail_step9000
    cache = tmp_path / "cache"
    with pytest.raises(
        HubRevisionError, match=r"downloading .* of org/pythia-tiny@step9000 .* failed.*run again to resume"
    ):
        resolve_sources([PYTHIA], revisions="step*", last=3, cache_dir=cache, endpoint=hub.url)
    first = {r["file"] for r in hub.downloads() if "/" + broken + "/" not in r["file"]}
    assert first and all(f"/{hub.commits['step8000']}/" in f for f in first)  # step8000 arrived complete

    hub.file_hook = None
    hub.requests.clear()
    sources = resolve_sources([PYTHIA], revisions="step*", last=3, cache_dir=cache, endpoint=hub.url)
    assert _downloaded_revisions(hub) == [
        hub.commits["step9000"],
        hub.commits["step10000"],
    ]  # step8000 not again
    for source, folder in zip(sources, checkpoints[-3:]):
        assert _weights_equal(source.path, folder)


# ---------------------------------------------------------------- CLI, card, push


def _online_env(hub, tmp_path) -> dict[str, str | None]:
    return dict(
        HF_HUB_OFFLINE=None,
        TRANSFORMERS_OFFLINE=None,
        HF_TOKEN=None,
        HF_ENDPOINT=hub.url,
        NO_PROXY="127.0.0.1,localhost",
        HF_HOME=str(tmp_path / "hf-home"),
    )


def _cli(args, hub, tmp_path):
    """``hf-pma ARGS`` as a process of its own: ``HF_ENDPOINT`` is read when huggingface_hub is imported."""
    return run_cli(*args, env=_online_env(hub, tmp_path), process=True)


def test_cli_merge_of_revisions_and_its_card(hub, checkpoints, tmp_path, monkeypatch):
    from hf_pma.publishing.card import build_model_card

    out = tmp_path / "merged"
    cache = tmp_path / "cli-cache"
    proc = _cli(
        [
            "merge",
            PYTHIA,
            "--revisions",
            "step*",
            "--every",
            "2",
            "--last",
            "3",
            "-o",
            str(out),
            "--cache-dir",
            str(cache),
            "-q",
        ],
        hub,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        any(cache.iterdir()) and not (tmp_path / "hf-home" / "hub").exists()
    )  # --cache-dir, not the default cache
    local = merge_checkpoints(
        [checkpoints[5], checkpoints[7], checkpoints[9]], tmp_path / "local", progress=False
    )
    assert _weights_equal(out, local)

    card = build_model_card(out, template=REPO_ROOT / "model_cards" / "pma_model_card.md")
    assert card.data.base_model == PYTHIA
    for step in (6000, 8000, 10000):
        assert f"step{step}" in card.text and hub.commits[f"step{step}"] in card.text
    assert f"'{PYTHIA}@step6000'," in card.text  # the merge code names the revisions

    # Bad input is one line: a pattern that matches nothing, or no Hub at all (HF_HUB_OFFLINE).
    bad = _cli(
        ["merge", PYTHIA, "--revisions", "nope*", "-o", str(tmp_path / "x"), "--cache-dir", str(cache)],
        hub,
        tmp_path,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("hf-pma merge: error: --revisions 'nope*' matches none of")
    )
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    offline = run_cli("merge", f"{PYTHIA}@step1000", "-o", tmp_path / "y", "--cache-dir", cache)
    assert offline.returncode == 2
    err = offline.stderr.strip().splitlines()
    assert (
        err[-1]
        == f"hf-pma merge: error: cannot read revision step1000 of {PYTHIA}: the Hub is off (HF_HUB_OFFLINE is set)"
    )


def test_push_of_a_revision_merge_credits_the_source_repo(hub, tmp_path):
    from huggingface_hub import ModelCard

    from hf_pma.publishing.hub import push_folder_to_hub

    sources = resolve_sources(
        [f"{OLMO}@{OLMO_NAMES[0]}", f"{OLMO}@{OLMO_NAMES[1]}"], cache_dir=tmp_path / "c", endpoint=hub.url
    )
    merged = merge_checkpoints(sources, tmp_path / "merged", progress=False)
    token = next(iter(hub.tokens))
    push_folder_to_hub(merged, "tester/olmo-pma", token=token, endpoint=hub.url)
    received = tmp_path / "README.md"
    received.write_bytes(hub.files("tester/olmo-pma")["README.md"])
    card = ModelCard.load(received)
    assert card.data.base_model == OLMO
    assert OLMO_NAMES[1] in card.text and "2,000,000,000" in card.text  # tokens parsed from the name


def test_pma_init_from_accepts_a_revision():
    from hf_pma.training.arguments import PMATrainingArguments

    args = PMATrainingArguments(output_dir="unused", pma_init_from=f"{PYTHIA}@step1000", report_to="none")
    assert args.pma_init_from == [f"{PYTHIA}@step1000"]
    with pytest.raises(ValueError, match="pma_init_from: no/such/folder does not exist"):
        PMATrainingArguments(output_dir="unused", pma_init_from="no/such/folder", report_to="none")


@pytest.mark.slow
def test_cli_eval_sweep_and_inspect_take_revisions(hub, tmp_path):
    from tests.helpers.data import sample_text

    text = tmp_path / "heldout.txt"
    text.write_text(sample_text(4000))
    cache = ["--cache-dir", str(tmp_path / "cache"), "-q"]
    common = ["--eval-file", str(text), "--block-size", "64", *cache]
    out = {name: tmp_path / f"{name}.json" for name in ("eval", "sweep", "inspect")}
    # one process for the three commands: HF_ENDPOINT is read when huggingface_hub is imported
    evaluated, swept, inspected = run_cli_in_one_process(
        ["eval", PYTHIA, f"{OLMO}@{OLMO_NAMES[0]}", "--revisions", "step*", "--last", "2", "-o", out["eval"], *common],
        [
            "sweep", PYTHIA, "--revisions", "/^step\\d+$/", "--last", "4", "--window", "2,4", "--every", "1",
            "--strategy", "sma", "-o", out["sweep"], "--no-plot", *common,
        ],
        [
            "inspect", PYTHIA, "--revisions", "step*", "--last", "3", "--window", "3", "--plot", "", "-o", out["inspect"],
            *cache,
        ],
        env=_online_env(hub, tmp_path),
    )

    assert evaluated.returncode == 0, evaluated.stderr
    labels = list(json.loads(out["eval"].read_text())["results"])
    assert labels == ["pythia-tiny@step9000", "pythia-tiny@step10000", f"olmo-tiny@{OLMO_NAMES[0]}"]

    assert swept.returncode == 0, swept.stderr
    report = json.loads(out["sweep"].read_text())
    assert [s["name"] for s in report["snapshots"]] == ["step7000", "step8000", "step9000", "step10000"]
    assert [c["snapshots"] for c in report["combinations"]] == [
        ["step9000", "step10000"],
        ["step7000", "step8000", "step9000", "step10000"],
    ]

    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(out["inspect"].read_text())
    assert [r["name"] for r in report["snapshots"]] == ["step8000", "step9000", "step10000"]
    assert report["window"]["names"] == ["step8000", "step9000", "step10000"]


def test_the_stand_in_serves_byte_ranges_as_hffilesystem_reads_them(hub, checkpoints):
    """Range reads (only the slices a merge needs) work through HfFileSystem: one ranged GET per block."""
    import struct

    from huggingface_hub import HfFileSystem

    data = (checkpoints[2] / "model.safetensors").read_bytes()
    fs = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    with fs.open(f"{PYTHIA}/model.safetensors", "rb", revision="step3000", block_size=4096) as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        start, stop = header["model.norm.weight"]["data_offsets"]
        f.seek(8 + size + start)
        assert f.read(stop - start) == data[8 + size + start : 8 + size + stop]
    ranges = [r["range"] for r in hub.downloads()]
    assert ranges and all(r.startswith("bytes=") for r in ranges)
    assert sum(int(r.split("-")[1]) - int(r[6:].split("-")[0]) + 1 for r in ranges) < len(
        data
    )  # not the whole file
