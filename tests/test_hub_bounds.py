"""Hub transfers bounded in total, wherever they go: per file, over all its requests and redirects.

The local Hub stand-in (``tests/helpers/hub_server.py``) serves, per repo, a file whose ``HEAD``
announces more than any disk, files that redirect to a CDN stand-in on another port (another
host) which sends 89 MiB for any of them, answers cut short after 16 bytes that announce the rest
every time, and API answers of the wrong JSON type. Each goes through the real commands, as
processes of their own (``HF_ENDPOINT`` is read at import): ``hf-pma merge org/model@REV``
(hf-pma's own downloads) and ``hf-pma eval MODEL --tokenizer org/model`` (the downloads
transformers and ``huggingface_hub`` make). Every case is one line and exit code 2, a bounded
number of bytes and requests, and nothing in the cache that looks complete.
"""

from __future__ import annotations

import pytest

from hf_pma.utils.hub_client import HUB_TIMEOUT_ENV
from hf_pma.utils.hub_transport import MAX_FILE_REQUESTS
from tests.helpers.cli import run_cli_in_one_process
from tests.helpers.data import local_model
from tests.helpers.hub_server import CDN_ANNOUNCED, CUT_BYTES, CdnServer, HubServer

# Repos whose file answers are hostile (hub_server's modes), and those whose API answers are JSON
# of the wrong type, with the command that reads that answer (transformers lists a tokenizer's
# tree; hf-pma reads a revision's info and the refs).
FILES = ("announce", "cdn", "cut", "cut2")  # cut2: cut, downloaded by hf-pma's merge
WRONG = {"tree": ("tree",), "info": ("info", "revision"), "refs": ("refs",)}
READ_BY = {"tree": "eval", "info": "merge", "refs": "merge"}


def _error_line(result, command):
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith(f"hf-pma {command}: ")]
    assert result.returncode == 2 and lines, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[-1]


def _complete_looking(root):
    """Files of a Hub cache under ``root`` that look like a downloaded file (not a lock, not a
    partial download)."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "/blobs/" in p.as_posix() and not p.name.endswith((".lock", ".incomplete"))
    ) + sorted(p.relative_to(root).as_posix() for p in root.rglob("snapshots/*/*"))


@pytest.fixture(scope="module")
def hub(model_files):
    with HubServer() as server, CdnServer() as cdn:
        for name in (*FILES, *WRONG):
            repo = f"evil/{name}-model"
            server.add_repo(repo)
            server.commit_files(repo, "main", model_files)
            server.set_branch(repo, "step300", "main")
        server.hostile = {
            "evil/announce-model": {"announce": True},
            "evil/cdn-model": {"cdn": cdn},
            "evil/cut-model": {"cut": True},
            "evil/cut2-model": {"cut": True},
            **{f"evil/{name}-model": {"wrong_type": kinds} for name, kinds in WRONG.items()},
        }
        yield server, cdn


@pytest.fixture(scope="module")
def runs(hub, model_files, tmp_path_factory):
    """``hf-pma eval`` of a local model with the tokenizer of each hostile repo (transformers
    downloads it), then ``hf-pma merge`` of a revision of each (hf-pma downloads it), with
    ``HF_PMA_HUB_TIMEOUT=2``; all in one process."""
    server, _ = hub
    root = tmp_path_factory.mktemp("runs")
    model, text = local_model(root, model_files)
    eval_names = ("announce", "cdn", "cut", "tree")
    merge_names = ("cdn", "cut2", "info")
    evals = [
        ["eval", model, "--tokenizer", f"evil/{n}-model", "--eval-file", text, "--block-size", "32", "-o", root / f"{n}.json", "-q"]
        for n in eval_names
    ]
    merges = [
        ["merge", f"evil/{n}-model@step300", "-o", root / "out" / n, "--cache-dir", root / "cache", "-q"]
        for n in merge_names
    ]
    merges.append(["merge", "evil/refs-model", "--revisions", "step*", "-o", root / "out" / "refs", "--cache-dir", root / "cache"])
    env = {
        "HF_HUB_OFFLINE": None,
        "TRANSFORMERS_OFFLINE": None,
        "HF_TOKEN": None,
        "HF_ENDPOINT": server.url,
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HOME": str(root / "hf-home"),
        # transformers' cut download ends at its file's deadline (2 s), long before huggingface_hub's
        # own 5 retries a second apart would end it
        HUB_TIMEOUT_ENV: "2",
    }
    results = run_cli_in_one_process(*evals, *merges, env=env, timeout=300)
    return {
        "eval": dict(zip(eval_names, results[: len(eval_names)])),
        "merge": dict(zip([*merge_names, "refs"], results[len(eval_names) :])),
        "root": root,
    }


def _gets(server, name, path=None):
    return [
        r for r in server.downloads()
        if r["file"].startswith(f"evil/{name}-model/") and (path is None or r["file"].endswith("/" + path))
    ]


def test_a_head_announcing_more_than_the_disk_holds_starts_no_download(runs, hub):
    server, _ = hub
    line = _error_line(runs["eval"]["announce"], "eval")
    assert "cannot load tokenizer evil/announce-model" in line and "no space left on the device" in line, line
    assert f"{2**50:,} bytes" in line and "models--evil--announce-model" in line, line
    assert _gets(server, "announce") == []  # refused at the HEAD: not one GET
    assert [p for p in _complete_looking(runs["root"] / "hf-home" / "hub") if "announce-model" in p] == []
    assert not (runs["root"] / "announce.json").exists()


def test_a_redirect_to_a_cdn_keeps_the_size_the_hub_announced(runs, hub, model_files):
    _, cdn = hub
    for command in ("eval", "merge"):
        line = _error_line(runs[command]["cdn"], command)
        # hf-pma's own download refuses at the CDN's Content-Length; transformers' at the 717th byte.
        assert ("sent more than" in line or "the Hub announces" in line) and "evil/cdn-model" in line, line
    # The client hangs up at the size the Hub announced: the CDN sent what the sockets' buffers took
    # meanwhile (some MiB on a loopback), far from its 89 MiB (64 MiB, the bound of an answer of
    # unknown size, without the file's transfer carried over the redirect).
    assert cdn.sent and all(n < CDN_ANNOUNCED // 2 for n in cdn.sent.values()), cdn.sent
    for cache in (runs["root"] / "hf-home" / "hub", runs["root"] / "cache"):
        assert [p for p in _complete_looking(cache) if "cdn-model" in p] == []
        assert [p for p in cache.rglob("*.incomplete") if "cdn-model" in str(p)] == []
    assert not (runs["root"] / "out" / "cdn").exists()


def test_answers_cut_short_are_resumed_a_bounded_number_of_times(runs, hub):
    server, _ = hub
    for command, name in (("merge", "cut2"), ("eval", "cut")):
        line = _error_line(runs[command][name], command)
        assert f"the Hub at {server.url} did not complete /evil/{name}-model/resolve/" in line, line
        # transformers' ends at the file's deadline; hf-pma's at the requests or the deadline
        assert "within 2 s, resumes included" in line or (name == "cut2" and f"in {MAX_FILE_REQUESTS} requests" in line), line
        assert [p for p in _complete_looking(runs["root"] / "cache") if f"{name}-model" in p] == []
        assert [p for p in _complete_looking(runs["root"] / "hf-home" / "hub") if f"{name}-model" in p] == []
    # Each transfer takes at most MAX_FILE_REQUESTS GETs: transformers' start at each HEAD (one per
    # hf_hub_download call), hf-pma's merge sends none.
    runs_of_gets, count = [], 0
    for r in server.requests:
        if r["kind"] == "resolve" and r["file"].startswith("evil/cut-model/"):
            count = 0 if r["method"] == "HEAD" else count + 1
            runs_of_gets.append(count)
    assert 0 < max(runs_of_gets) <= MAX_FILE_REQUESTS, runs_of_gets
    assert 0 < len(_gets(server, "cut2")) <= MAX_FILE_REQUESTS
    assert 0 < server.sent[("evil/cut2-model", "config.json")] <= MAX_FILE_REQUESTS * CUT_BYTES


@pytest.mark.parametrize("name", list(WRONG))
def test_an_api_answer_of_the_wrong_json_type_is_one_line(runs, name):
    command = READ_BY[name]
    line = _error_line(runs[command][name], command)
    assert "is malformed" in line and f"evil/{name}-model" in line, line
    assert not (runs["root"] / "out" / name).exists() and not (runs["root"] / f"{name}.json").exists()



# ---------------------------------------------------------------- the transport, as a library


@pytest.fixture
def client():
    """An ``httpx2`` client over hf-pma's bounded transport, 30 s per answer (far from any bound here)."""
    import httpx2

    from hf_pma.utils.hub_client import api_answer_check
    from hf_pma.utils.hub_transport import BoundedTransport

    with httpx2.Client(
        transport=BoundedTransport(httpx2.HTTPTransport(), lambda: 30, api_answer_check), follow_redirects=True
    ) as c:
        yield c


def _served(hub, name, files):
    server, cdn = hub
    repo = f"lib/{name}-model"
    server.add_repo(repo)
    oid = server.commit_files(repo, "main", files)
    return f"{server.url}/{repo}/resolve/{oid}"


def _drain(client, url, **headers):
    with client.stream("GET", url, headers=headers) as response:
        return sum(len(chunk) for chunk in response.iter_bytes())


def test_resumes_of_one_file_are_bounded_in_requests(hub, client):
    """A file whose every answer is cut short after 16 bytes, resumed as huggingface_hub resumes
    it: the request after MAX_FILE_REQUESTS is refused before it is sent, whatever the clock says."""
    import httpx2

    from hf_pma.utils.hub_transport import HubTransferRefused

    server, _ = hub
    base = _served(hub, "cut", {"weights.bin": bytes(4096)})
    server.hostile["lib/cut-model"] = {"cut": True}
    url = f"{base}/weights.bin"
    assert client.head(url).headers["X-Linked-Size"] == "4096"
    have = 0
    with pytest.raises(HubTransferRefused, match=f"did not complete .*weights.bin in {MAX_FILE_REQUESTS} requests"):
        for _ in range(4096 // CUT_BYTES):
            try:
                have += _drain(client, url, **({"Range": f"bytes={have}-"} if have else {}))
            except httpx2.RemoteProtocolError:  # cut short: resumed where it stopped
                have += CUT_BYTES
    assert len([r for r in server.downloads() if r["file"].startswith("lib/cut-model/")]) == MAX_FILE_REQUESTS


def test_block_reads_of_a_file_are_answers_of_their_own(hub, client):
    """``HfFileSystem`` and ``datasets`` read a file in blocks (closed ranges), as many as it
    takes: not resumes, so not held to MAX_FILE_REQUESTS; each block at most the bytes it asks for."""
    data = bytes(range(256)) * 32
    base = _served(hub, "blocks", {"data.parquet": data})
    url = f"{base}/data.parquet"
    assert client.head(url).headers["Content-Length"] == str(len(data))  # a transfer of the file starts
    blocks = []
    for start in range(0, len(data), 256):
        response = client.get(url, headers={"Range": f"bytes={start}-{start + 255}"})
        assert response.status_code == 206
        blocks.append(response.content)
    assert len(blocks) > 2 * MAX_FILE_REQUESTS and b"".join(blocks) == data


def test_a_cdn_redirect_carries_the_size_of_a_transfer_started_without_a_head(hub, client):
    """hf-pma's own downloads send no HEAD: the size from the repo's metadata goes with the GET
    over the Hub's redirect to the CDN (another host), which announces and sends 89 MiB."""
    from hf_pma.utils.hub_transport import HubAnswerTooLarge, expect_transfer

    server, cdn = hub
    base = _served(hub, "lib-cdn", {"tokenizer.json": bytes(717)})
    server.hostile["lib/lib-cdn-model"] = {"cdn": cdn}
    expect_transfer(f"{base}/tokenizer.json", 717)
    with pytest.raises(HubAnswerTooLarge, match="sent more than 717 bytes for /cdn/lib/lib-cdn-model/tokenizer.json"):
        _drain(client, f"{base}/tokenizer.json")
    assert 0 < cdn.sent["/cdn/lib/lib-cdn-model/tokenizer.json"] < CDN_ANNOUNCED // 2


def test_a_head_larger_than_the_free_space_is_refused_before_any_get(hub, client, tmp_path, monkeypatch):
    """Refused before any GET; unless the cache holds that content already (a load of a cached
    model asks the Hub first, and downloads nothing)."""
    import hashlib

    from huggingface_hub import constants

    from hf_pma.utils.fs import NoSpaceError

    server, _ = hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    base = _served(hub, "lib-huge", {"model.safetensors": bytes(100)})
    server.hostile["lib/lib-huge-model"] = {"announce": True}
    with pytest.raises(NoSpaceError, match=f"models--lib--lib-huge-model/model.safetensors; it needs .*{2**50:,} bytes"):
        client.head(f"{base}/model.safetensors")
    assert not [r for r in server.downloads() if r["file"].startswith("lib/lib-huge-model/")]
    blob = tmp_path / "hub" / "models--lib--lib-huge-model" / "blobs" / hashlib.sha256(bytes(100)).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(bytes(100))
    assert client.head(f"{base}/model.safetensors").status_code == 200


@pytest.mark.parametrize(
    ("path", "answer", "said"),
    [
        ("/api/models/a/b/tree/main", {"path": "x"}, "the tree listing is an object, where a list belongs"),
        ("/api/models/a/b/tree/main/sub", ["x"], "entry 0 is a string, where an object belongs"),
        ("/api/models/a/b/tree/main", [{"type": "file", "path": "x", "oid": "0" * 40, "size": "9"}], "entry 0's size is a string"),
        ("/api/models/a/b/paths-info/main", [{"type": "file", "path": 7, "oid": "0", "size": 1}], "entry 0's path is a number"),
        ("/api/models/a/b", [], "the repo's info is a list"),
        ("/api/models/a/b/revision/main", {"siblings": [{"rfilename": None}]}, "siblings[0].rfilename is null"),
        ("/api/models/a/b", {"siblings": [{"rfilename": "x", "lfs": {"sha256": "0", "size": -1}}]}, "siblings[0].lfs.size is a number, where a byte count"),
        ("/api/models/a/b", {"tags": [{}]}, "tags[0] is an object"),
        ("/api/models/a/b/refs", {"branches": [{"name": "main", "ref": "refs/heads/main"}], "tags": [], "converts": []}, "branches[0].targetCommit is null"),
        ("/api/models/gpt2/refs", ["main"], "the refs is a list"),  # refs of gpt2, or info of gpt2/refs: neither
        ("/api/datasets/a/b/tree/main", True, "the tree listing is a boolean"),
    ],
)
def test_an_api_answer_of_the_wrong_type_is_one_line(path, answer, said):
    from hf_pma.utils.hub_client import HubAnswerError, api_answer_check

    with pytest.raises(HubAnswerError) as caught:
        api_answer_check(path)(answer)
    assert said in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_the_answers_of_a_real_hub_api_pass_the_check(hub, client):
    """What the Hub stand-in answers (the Hub's format) is accepted: the check refuses types, not answers."""
    server, _ = hub
    base = server.url
    for path in (
        "/api/models/evil/cut-model",
        "/api/models/evil/cut-model/revision/main?blobs=true",
        "/api/models/evil/cut-model/tree/main",
        "/api/models/evil/cut-model/refs",
    ):
        assert client.get(base + path).status_code == 200, path


def test_the_docs_quote_the_bounds_the_code_sets():
    from hf_pma.utils.hub_transport import MIN_DOWNLOAD_RATE
    from tests.helpers.repo import REPO_ROOT

    text = (REPO_ROOT / "docs" / "reliability.md").read_text()
    assert f"{MAX_FILE_REQUESTS} `GET`s per file" in text
    assert f"one second per {MIN_DOWNLOAD_RATE // 2**10} KiB announced" in text


def test_a_script_parsed_by_hf_pma_downloads_through_the_bounded_client():
    """scripts/pretrain.py loads its tokenizer, config and model from the Hub with transformers
    after it parses its arguments (parse_with_config): from then on, huggingface_hub's shared
    client is hf-pma's bounded one, so those downloads are bounded too."""
    import dataclasses

    from huggingface_hub.utils import _http
    from transformers import HfArgumentParser

    from hf_pma.training.arguments import parse_with_config
    from hf_pma.utils import hub_client

    @dataclasses.dataclass
    class Options:
        name: str = "x"

    before = _http._GLOBAL_CLIENT_FACTORY
    _http.set_client_factory(_http.default_client_factory)
    try:
        (options,) = parse_with_config(HfArgumentParser([Options]), ["--name", "y"])
        assert options.name == "y" and _http._GLOBAL_CLIENT_FACTORY is hub_client._client_factory
    finally:
        _http.set_client_factory(before)


@pytest.mark.parametrize("value", ["²", "9" * 5000, "-1", "1e9", "0x10", " 12 34", ""])
def test_a_size_header_that_is_not_a_plain_number_is_no_size(value):
    """``"²".isdigit()`` is true and ``int("9" * 5000)`` raises: a size is ASCII digits, at most 19."""
    from hf_pma.utils.hub_transport import header_size

    assert header_size(value) is None
    assert header_size(" 1234 ") == 1234 and header_size("9" * 19) == int("9" * 19)


def _answering(handler):
    """A client over hf-pma's bounded transport whose answers ``handler(request)`` makes."""
    import httpx2

    from hf_pma.utils.hub_transport import BoundedTransport

    return httpx2.Client(transport=BoundedTransport(httpx2.MockTransport(handler), lambda: 30), follow_redirects=True)


@pytest.mark.parametrize("header", ["x-linked-size", "content-length", "content-range"])
@pytest.mark.parametrize("value", ["²", "9" * 5000])
def test_size_headers_that_are_no_number_leave_the_bounds_in_force(header, value):
    """A file answer whose size headers cannot be read as a number is bounded as one that gives
    none (at most MAX_ANSWER_BYTES), never an error of the parser."""
    import httpx2

    text = f"bytes 0-9/{value}" if header == "content-range" else value
    headers = [(header.encode(), text.encode())]  # as a server sends them: bytes, "²" in UTF-8

    def handler(request):
        return httpx2.Response(200, headers=headers, content=b"x" * 10)

    with _answering(handler) as c:
        assert len(c.get("https://hub.example/org/m/resolve/main/f.bin").content) == 10


def test_a_block_read_gets_no_more_than_the_bytes_it_asked_for():
    """A block read (``Range: bytes=0-99``, as HfFileSystem and datasets read) answered with the
    whole file (200, 80 MiB announced) is refused after its 100 bytes, whatever was announced."""
    import httpx2

    from hf_pma.utils.hub_transport import HubAnswerTooLarge

    big = 80 * 2**20

    def handler(request):
        return httpx2.Response(200, headers={"Content-Length": str(big)}, content=b"\0" * big)

    with _answering(handler) as c, pytest.raises(HubAnswerTooLarge):
        c.get("https://hub.example/org/m/resolve/main/data.parquet", headers={"Range": "bytes=0-99"})
