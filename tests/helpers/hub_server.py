"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for push tests without the internet.

It answers, over real HTTP, the endpoints that ``huggingface_hub`` 2.4 calls for
``HfApi.create_repo``, ``create_branch``, ``repo_info``, ``list_repo_refs``, ``upload_folder``
(with or without ``hf_xet``) and ``hf_hub_download`` / ``HfFileSystem`` reads:

* ``POST /api/repos/create``                       -> ``{"url": ...}`` (409 when it exists)
* ``GET  /api/models/{repo}[/revision/{rev}]``     -> repo info (``id``, ``sha``, ``lastModified``,
  ``siblings``; with ``?blobs=true`` each sibling's ``size``, ``blobId`` and ``lfs``)
* ``GET  /api/models/{repo}/refs``                 -> branches and tags
* ``GET  /api/models/{repo}/tree/{rev}``           -> the files at a revision (for ``HfFileSystem``)
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``        -> the file at a branch, tag or commit, with the
  Hub's headers (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS files)
  and ``Range: bytes=a-b`` answered with 206
* ``POST /api/models/{repo}/branch/{branch}``      -> creates a branch from main (409 if it exists)
* ``POST /api/models/{repo}/preupload/{rev}``      -> ``uploadMode: "regular"`` for every file
* ``POST /api/models/{repo}/commit/{rev}``         -> NDJSON: header line, then files in base64
* ``POST /api/validate-yaml``                      -> no errors (used without ``hf_xet``)

Reads of a public repo need no token (as on the Hub); a wrong token is refused everywhere.

Received files are kept per repo and branch (``server.files(repo_id, branch)``) so tests can
compare bytes, and every request is logged (``server.requests``). Tests build repos with history
directly: ``server.add_repo``, ``server.commit_files`` (one commit on a branch, with a date) and
``server.add_tag``. ``server.file_hook(request)`` may answer a file request with an HTTP status, or
``("drop", n)`` to send the headers and ``n`` bytes of the body, then close the connection (an
interrupted download); ``server.declared_sizes[(repo_id, path)]`` makes the metadata report another
size for a file (a repo bigger than the disk). ``server.fail_status`` makes
every API request answer that status (401, 403, ...); ``server.fail_on`` limits it to
endpoints whose kind is listed ("create", "preupload", "commit", ...). Only tokens in
``server.tokens`` are accepted (401 otherwise).

A hostile Hub, per repo: ``server.hostile[repo_id]`` is a dict of what that repo's answers do
(every other repo answers as the Hub does):

* ``"commit": TEXT``: the commit id in ``model_info``, the refs and ``X-Repo-Commit`` (file reads
  at that "commit" serve the main branch's files);
* ``"etag": TEXT``: the ``ETag`` and ``X-Linked-Etag`` of every file;
* ``"endless": True``: file bodies (GET) without a ``Content-Length`` that do not end (the
  metadata still announces the real size), until the client hangs up or ``ENDLESS_CAP`` bytes;
  ``server.sent[(repo_id, path)]`` counts what was sent;
* ``"served": {path: bytes}``: those bytes are served for ``path`` while the metadata (size,
  sha256, blob id, ETag) describes the committed ones: a file changed on the way;
* ``"silent": True``: the server reads each request and never answers (until it stops);
* ``"drip": True``: API answers (repo info, refs, tree) send their headers, then one byte of
  the body every ``DRIP_S`` seconds (``"drip_headers": True``: the status line and headers
  themselves come one byte at a time); ``server.sent[(repo_id, "api")]`` counts the bytes sent;
* ``"bomb": True``: API answers are a gzip body of ``BOMB_COMPRESSED`` bytes (about 509 KB) that
  inflates to ``BOMB_INFLATED`` (512 MiB) of zeros, announced with ``Content-Encoding: gzip``;
* ``"huge": True``: API answers announce ``BOMB_INFLATED`` bytes and send zeros until the client
  hangs up;
* ``"redirects": True``: API answers wait ``REDIRECT_WAIT_S`` seconds, then redirect to the same
  URL (each within any read timeout; ``server.sent[(repo_id, "api")]`` counts the redirects).
* ``"announce": True``: file answers announce ``HUGE_ANNOUNCED`` bytes (more than any disk);
* ``"cdn": CdnServer``: file answers redirect to that CDN stand-in (another host), announcing
  the real size (``X-Linked-Size``); the CDN sends ``CDN_ANNOUNCED`` bytes for any file;
* ``"cut": True``: file answers announce the rest of the file (``X-Linked-Size``, and a ``206``'s
  ``Content-Range`` from a ``Range``), send ``CUT_BYTES`` of it (one chunk) and hang up, every time;
* ``"wrong_type": (KIND, ...)``: those API answers (``info``, ``revision``, ``tree``, ``refs``)
  are JSON of another type than theirs (``WRONG_TYPES``).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import fnmatch
import hashlib
import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

USER = "tester"
_REPO_API = re.compile(
    r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+(?:/[^/]+)??)"
    r"(?:/(?P<kind>preupload|commit|branch|revision|refs|tree)(?:/(?P<rev>.+))?)?$"
)
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
# Stored with Git LFS on the Hub (sha256 ETag, X-Linked-* headers); the rest are regular git blobs.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.model", "*.msgpack", "*.h5")
_EPOCH = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
# What an endless body sends at most before the stand-in gives up itself (the test would have failed).
ENDLESS_CAP = 256 * 2**20
# A dripping answer's pace, and how long it drips at most.
DRIP_S = 0.5
DRIP_BYTES = 4096
REDIRECT_WAIT_S = 0.9
# The gzip bomb: 512 MiB of zeros, compressed (made once per process, on first use).
BOMB_INFLATED = 512 * 2**20
_bomb: list[bytes] = []
# What an "announce" file's HEAD says it holds (more than any disk), and what a "cut" answer sends.
HUGE_ANNOUNCED = 2**50
CUT_BYTES = 16
# What a CDN stand-in announces for any file (and sends until the client hangs up, or the cap).
CDN_ANNOUNCED = 89 * 2**20
# The answers of "wrong_type": JSON, but not of the type the endpoint gives.
WRONG_TYPES: dict[str, Any] = {
    "tree": {"type": "file", "path": "tokenizer.json"},
    "info": [{"rfilename": "model.safetensors"}],
    "revision": [{"rfilename": "model.safetensors"}],
    "refs": {"branches": "main", "tags": [], "converts": []},
}


def gzip_bomb() -> bytes:
    """``BOMB_INFLATED`` zero bytes, gzip-compressed (about 509 KB)."""
    if not _bomb:
        import zlib

        packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        block = bytes(2**20)
        parts = [packer.compress(block) for _ in range(BOMB_INFLATED // len(block))]
        _bomb.append(b"".join(parts) + packer.flush())
    return _bomb[0]


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob, as the Hub reports for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    """Whether the Hub would store ``path`` with Git LFS (weights, tokenizer models)."""
    return any(fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern) for pattern in LFS_PATTERNS)


class _Repo:
    def __init__(self, repo_id: str, private: bool) -> None:
        self.repo_id = repo_id
        self.private = private
        first = hashlib.sha1(repo_id.encode()).hexdigest()
        self.branches: dict[str, dict[str, bytes]] = {"main": {}}
        self.heads: dict[str, str] = {"main": first}
        self.tags: dict[str, str] = {}
        self.trees: dict[str, dict[str, bytes]] = {first: {}}  # commit -> files, for reads by commit
        self.dates: dict[str, datetime.datetime] = {first: _EPOCH}
        self.commits: list[dict[str, Any]] = []

    def resolve(self, rev: str) -> str | None:
        """The commit of a branch, a tag or a (full) commit id; ``None`` when unknown."""
        if rev in self.branches:
            return self.heads[rev]
        if rev in self.tags:
            return self.tags[rev]
        return rev if rev in self.trees else None

    def set_head(self, branch: str, oid: str, tree: dict[str, bytes], date: datetime.datetime | None = None) -> None:
        self.branches[branch] = tree
        self.heads[branch] = oid
        self.trees[oid] = dict(tree)
        self.dates[oid] = date or datetime.datetime.now(datetime.timezone.utc)


class HubServer:
    """The server and what it received. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(self, tokens: tuple[str, ...] = ("hf_test_token_for_the_local_hub_0000",)) -> None:
        self.tokens = set(tokens)
        self.repos: dict[str, _Repo] = {}
        self.requests: list[dict[str, Any]] = []
        self.fail_status: int | None = None
        self.fail_on: set[str] | None = None
        self.file_hook: Callable[[dict[str, Any]], Any] | None = None
        self.declared_sizes: dict[tuple[str, str], int] = {}
        self.hostile: dict[str, dict[str, Any]] = {}
        self.sent: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True  # a silent answer must not hold stop() up
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """The endpoint to give ``HfApi(endpoint=...)`` or ``HF_ENDPOINT``."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        """Serve in a daemon thread."""
        # shutdown() waits for the serving loop's next poll: 0.5 s by default, at every test's end
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------ what tests read

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        """The files of ``repo_id`` at ``branch``: path -> bytes."""
        return dict(self.repos[repo_id].branches[branch])

    def uploads(self) -> list[dict[str, Any]]:
        """The requests that carried file content (preupload and commit)."""
        return [r for r in self.requests if r["kind"] in ("preupload", "commit")]

    def downloads(self) -> list[dict[str, Any]]:
        """The GET requests for file content (``file`` is ``repo/rev/path``, ``range`` the Range header)."""
        return [r for r in self.requests if r["kind"] == "resolve" and r["method"] == "GET"]

    # ------------------------------------------------------------ what tests build

    def add_repo(self, repo_id: str, private: bool = False) -> None:
        """Create an empty model repo (main has no files)."""
        with self._lock:
            self.repos[repo_id] = _Repo(repo_id, private)

    def commit_files(
        self, repo_id: str, branch: str, files: dict[str, bytes], message: str = "", date: datetime.datetime | None = None
    ) -> str:
        """Commit ``files`` (path -> bytes, replacing the branch's files) on ``branch`` (created when
        missing); returns the commit id. ``date`` is the commit's date (default: now)."""
        with self._lock:
            repo = self.repos[repo_id]
            parent = repo.heads.get(branch, "")
            oid = hashlib.sha1(json.dumps([branch, message, sorted(files)]).encode() + parent.encode()).hexdigest()
            if oid in repo.trees:  # the same files committed twice on a branch: a new commit all the same
                oid = hashlib.sha1((oid + str(len(repo.commits))).encode()).hexdigest()
            repo.set_head(branch, oid, dict(files), date)
            repo.commits.append({"branch": branch, "oid": oid, "summary": message, "files": sorted(files)})
            return oid

    def set_branch(self, repo_id: str, branch: str, revision: str) -> str:
        """Point ``branch`` (created when missing) at the commit of ``revision``; returns the commit id."""
        with self._lock:
            repo = self.repos[repo_id]
            oid = repo.resolve(revision)
            if oid is None:
                raise KeyError(f"no revision {revision} in {repo_id}")
            repo.branches[branch] = dict(repo.trees[oid])
            repo.heads[branch] = oid
            return oid

    def add_tag(self, repo_id: str, tag: str, revision: str) -> str:
        """Tag the commit of ``revision`` (a branch, tag or commit id); returns the commit id."""
        with self._lock:
            repo = self.repos[repo_id]
            oid = repo.resolve(revision)
            if oid is None:
                raise KeyError(f"no revision {revision} in {repo_id}")
            repo.tags[tag] = oid
            return oid

    # ------------------------------------------------------------ handler

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                server._dispatch(self, "GET")

            def do_POST(self) -> None:
                server._dispatch(self, "POST")

            def do_HEAD(self) -> None:
                server._dispatch(self, "HEAD")

        return Handler

    def _reply(self, handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if status >= 400 and isinstance(body, dict) and "error" in body:
            handler.send_header("X-Error-Message", body["error"])
            if body.get("code"):
                handler.send_header("X-Error-Code", body["code"])
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def _dispatch(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        split = urlsplit(handler.path)
        path = split.path
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        auth = handler.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        match = _REPO_API.match(path)
        resolve = _RESOLVE.match(path)
        if path == "/api/repos/create":
            kind = "create"
        elif path == "/api/validate-yaml":
            kind = "validate-yaml"
        elif match:
            kind = match.group("kind") or "info"
        elif resolve:
            kind = "resolve"
        else:
            kind = "unknown"
        record = {"method": method, "path": path, "kind": kind, "has_token": token is not None, "bytes": len(body)}
        if resolve:
            rev = unquote(resolve.group("rev"))
            record.update(file=f"{resolve.group('repo')}/{rev}/{unquote(resolve.group('file'))}", range=handler.headers.get("Range"))
        with self._lock:
            self.requests.append(record)
        if self.fail_status is not None and (self.fail_on is None or kind in self.fail_on):
            self._reply(handler, self.fail_status, {"error": f"refused by the test Hub ({self.fail_status})"})
            return
        repo_name = (match.group("repo") if match else resolve.group("repo") if resolve else None) or ""
        if self.hostile.get(repo_name, {}).get("silent"):
            self._stopping.wait(timeout=600)  # the connection stays open; no answer ever comes
            handler.close_connection = True
            return
        mode = self.hostile.get(repo_name, {})
        if kind in ("info", "revision", "refs", "tree") and {"drip", "drip_headers", "bomb", "huge", "redirects"} & set(mode):
            self._serve_hostile_api(handler, repo_name, mode)
            return
        if kind in mode.get("wrong_type", ()):  # valid JSON of another type than the endpoint's
            self._reply(handler, 200, WRONG_TYPES[kind])
            return
        # Reads need no token unless the repo is private (a missing repo answers 404 RepoNotFound).
        public_read = method in ("GET", "HEAD") and bool(repo_name) and not (repo_name in self.repos and self.repos[repo_name].private)
        if token not in self.tokens and not (token is None and public_read):
            self._reply(handler, 401, {"error": "Invalid credentials in Authorization header"})
            return
        if resolve:
            self._serve_file(handler, method, record, resolve)
            return
        query = parse_qs(split.query)
        with self._lock:
            try:
                status, answer = self._handle(method, kind, match, path, body, query)
            except Exception as err:  # a bug here should show up as a clear HTTP error in the test
                status, answer = 500, {"error": f"test Hub failed: {err!r}"}
        self._reply(handler, status, answer)

    def _handle(
        self, method: str, kind: str, match: re.Match | None, path: str, body: bytes, query: dict[str, list[str]]
    ) -> tuple[int, Any]:
        if kind == "create" and method == "POST":
            payload = json.loads(body)
            repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            self.repos[repo_id] = _Repo(repo_id, payload.get("visibility") == "private")
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        if kind == "validate-yaml":
            return 200, {"errors": [], "warnings": []}
        if match is None:
            return 404, {"error": f"unknown endpoint {method} {path}"}
        repo = self.repos.get(match.group("repo"))
        if repo is None:
            return 404, {"error": "Repository not found", "code": "RepoNotFound"}
        rev = unquote(match.group("rev") or "main")
        if kind in ("info", "revision") and method in ("GET", "HEAD"):
            oid = repo.resolve(rev)
            if oid is None:
                return 404, {"error": f"Invalid rev id: {rev}", "code": "RevisionNotFound"}
            blobs = query.get("blobs") == ["true"]
            siblings = [self._sibling(repo, name, data, blobs) for name, data in sorted(repo.trees[oid].items())]
            date = repo.dates[oid].strftime("%Y-%m-%dT%H:%M:%S.000Z")
            sha = self.hostile.get(repo.repo_id, {}).get("commit", oid)
            return 200, {"id": repo.repo_id, "sha": sha, "private": repo.private, "lastModified": date, "siblings": siblings}
        if kind == "tree" and method == "GET":
            oid = repo.resolve(rev.split("/", 1)[0])
            if oid is None:
                return 404, {"error": f"Invalid rev id: {rev}", "code": "RevisionNotFound"}
            return 200, [self._tree_entry(repo, name, data) for name, data in sorted(repo.trees[oid].items())]
        if kind == "refs":
            fake = self.hostile.get(repo.repo_id, {}).get("commit")
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": fake or repo.heads[b]} for b in repo.branches]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": fake or oid} for t, oid in repo.tags.items()]
            return 200, {"branches": branches, "converts": [], "tags": tags}
        if kind == "branch" and method == "POST":
            if rev in repo.branches:
                return 409, {"error": f"Reference already exists: refs/heads/{rev}"}
            repo.branches[rev] = dict(repo.branches["main"])
            repo.heads[rev] = repo.heads["main"]
            return 200, {}
        if kind in ("preupload", "commit") and rev not in repo.branches and repo.resolve(rev) is not None:
            return 400, {"error": f"{rev} is not a branch: cannot write to it"}
        if kind == "preupload" and method == "POST":
            if rev not in repo.branches:
                return 404, {"error": f"Invalid rev id: {rev}"}
            existing = repo.branches[rev]
            files = json.loads(body)["files"]
            return 200, {
                "files": [
                    {
                        "path": f["path"],
                        "uploadMode": "regular",
                        "shouldIgnore": False,
                        "oid": git_blob_sha1(existing[f["path"]]) if f["path"] in existing else None,
                    }
                    for f in files
                ]
            }
        if kind == "commit" and method == "POST":
            return self._commit(repo, rev, body)
        return 404, {"error": f"unknown endpoint {method} {path}"}

    def _commit(self, repo: _Repo, rev: str, body: bytes) -> tuple[int, Any]:
        if rev not in repo.branches:
            return 404, {"error": f"Invalid rev id: {rev}"}
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            return 400, {"error": "the first NDJSON line must be the commit header"}
        header = lines[0]["value"]
        tree = dict(repo.branches[rev])
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    return 400, {"error": f"unsupported encoding for {value.get('path')}"}
                tree[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                tree.pop(value["path"], None)
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                tree = {p: d for p, d in tree.items() if not p.startswith(prefix)}
            else:
                # This server only says "regular": an LFS or Xet file here is a client surprise.
                return 400, {"error": f"unexpected commit operation {key!r}"}
        oid = hashlib.sha1(json.dumps([header, sorted(tree)]).encode() + repo.heads[rev].encode()).hexdigest()
        repo.set_head(rev, oid, tree)
        repo.commits.append({"branch": rev, "oid": oid, "summary": header.get("summary"), "files": sorted(tree)})
        return 200, {"commitUrl": f"{self.url}/{repo.repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    # ------------------------------------------------------------ file reads

    def _size(self, repo: _Repo, path: str, data: bytes) -> int:
        return self.declared_sizes.get((repo.repo_id, path), len(data))

    def _sibling(self, repo: _Repo, path: str, data: bytes, blobs: bool) -> dict[str, Any]:
        sibling: dict[str, Any] = {"rfilename": path}
        if blobs:
            size = self._size(repo, path, data)
            sibling.update(size=size, blobId=git_blob_sha1(data))
            if is_lfs(path):
                sibling["lfs"] = {"size": size, "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return sibling

    def _tree_entry(self, repo: _Repo, path: str, data: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "path": path, "oid": git_blob_sha1(data), "size": self._size(repo, path, data)}
        if is_lfs(path):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": entry["size"], "pointerSize": 134}
        return entry

    def _serve_file(self, handler: BaseHTTPRequestHandler, method: str, record: dict[str, Any], match: re.Match) -> None:
        repo = self.repos.get(match.group("repo"))
        if repo is None:
            self._reply(handler, 404, {"error": "Repository not found", "code": "RepoNotFound"})
            return
        rev, path = unquote(match.group("rev")), unquote(match.group("file"))
        hostile = self.hostile.get(repo.repo_id, {})
        if "commit" in hostile and rev == hostile["commit"]:
            rev = "main"
        with self._lock:
            oid = repo.resolve(rev)
            data = repo.trees[oid].get(path) if oid is not None else None
        if oid is None:
            self._reply(handler, 404, {"error": f"Invalid rev id: {rev}", "code": "RevisionNotFound"})
            return
        if data is None:
            handler.send_response(404)
            handler.send_header("X-Repo-Commit", oid)
            handler.send_header("X-Error-Code", "EntryNotFound")
            handler.send_header("X-Error-Message", f"{path} does not exist at {rev}")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        action = self.file_hook(record) if self.file_hook is not None else None
        if isinstance(action, int):
            self._reply(handler, action, {"error": f"refused by the test Hub ({action})"})
            return
        lfs = is_lfs(path)
        etag = hostile.get("etag") or (hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data))
        size = self._size(repo, path, data)
        data = hostile.get("served", {}).get(path, data)
        oid = hostile.get("commit", oid)
        if hostile.get("endless") and method == "GET":
            self._serve_endless(handler, repo.repo_id, path, oid, etag, size)
            return
        if {"announce", "cdn", "cut"} & set(hostile):
            self._serve_unbounded(handler, method, hostile, repo.repo_id, path, oid, etag, len(data))
            return
        start, stop = 0, len(data)
        ranged = handler.headers.get("Range")
        if ranged and method == "GET":
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", ranged.strip())
            if m is None or int(m.group(1)) >= len(data):
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{len(data)}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
            start = int(m.group(1))
            stop = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
        body = data[start:stop]
        handler.send_response(206 if ranged and method == "GET" else 200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("X-Repo-Commit", oid)
        handler.send_header("ETag", f'"{etag}"')
        if lfs:
            handler.send_header("X-Linked-Etag", f'"{etag}"')
            handler.send_header("X-Linked-Size", str(size))
        if ranged and method == "GET":
            handler.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if method == "HEAD":
            return
        if isinstance(action, tuple) and action[0] == "drop":
            # An interrupted download: part of the body, then the connection goes away.
            handler.wfile.write(body[: int(action[1])])
            handler.wfile.flush()
            handler.close_connection = True
            return
        handler.wfile.write(body)

    def _serve_unbounded(
        self, handler: BaseHTTPRequestHandler, method: str, mode: dict[str, Any], repo_id: str, path: str, oid: str, etag: str, size: int
    ) -> None:
        """A file answer that would take more than the file (see the module's ``announce``,
        ``cdn`` and ``cut`` modes); ``server.sent[(repo_id, path)]`` counts the bytes sent."""
        ranged = re.fullmatch(r"bytes=(\d+)-", (handler.headers.get("Range") or "").strip())
        start = int(ranged.group(1)) if ranged and method == "GET" else 0
        cdn = mode.get("cdn")
        handler.send_response(302 if cdn else 206 if start else 200)
        handler.send_header("X-Repo-Commit", oid)
        handler.send_header("ETag", f'"{etag}"')
        handler.send_header("X-Linked-Etag", f'"{etag}"')
        handler.send_header("X-Linked-Size", str(HUGE_ANNOUNCED if mode.get("announce") else size))
        if cdn:
            handler.send_header("Location", f"{cdn.url}/cdn/{repo_id}/{path}")
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        cut = method == "GET" and mode.get("cut")
        if cut:  # chunked: the 16 bytes arrive (progress, for a client) before the answer breaks off
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Content-Length", "0" if cdn else str(HUGE_ANNOUNCED if mode.get("announce") else size))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        if cut:  # 16 bytes of the rest, then hang up
            n = min(CUT_BYTES, size - start)
            with self._lock:  # counted before it can arrive
                self.sent[(repo_id, path)] = self.sent.get((repo_id, path), 0) + n
            handler.wfile.write(b"%x\r\n" % n + b"\0" * n + b"\r\n")
            handler.wfile.flush()

    def _count_sent(self, repo_id: str, n: int) -> None:
        with self._lock:
            self.sent[(repo_id, "api")] = self.sent.get((repo_id, "api"), 0) + n

    def _serve_hostile_api(self, handler: BaseHTTPRequestHandler, repo_id: str, mode: dict[str, Any]) -> None:
        """An API answer that drips, inflates or never ends (see the module's ``hostile`` modes)."""
        handler.close_connection = True
        try:
            if mode.get("drip_headers"):
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * DRIP_BYTES
                for i in range(len(head)):
                    if self._stopping.wait(DRIP_S):
                        return
                    handler.wfile.write(head[i : i + 1])
                    handler.wfile.flush()
                    self._count_sent(repo_id, 1)
                return
            if mode.get("redirects"):
                if self._stopping.wait(REDIRECT_WAIT_S):
                    return
                handler.send_response(302)
                handler.send_header("Location", handler.path)
                handler.send_header("Content-Length", "0")
                handler.send_header("Connection", "close")
                handler.end_headers()
                self._count_sent(repo_id, 1)
                return
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            if mode.get("bomb"):
                body = gzip_bomb()
                handler.send_header("Content-Encoding", "gzip")
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)
                self._count_sent(repo_id, len(body))
                return
            if mode.get("huge"):
                handler.send_header("Content-Length", str(BOMB_INFLATED))
                handler.end_headers()
                chunk = b"\0" * 65536
                for _ in range(BOMB_INFLATED // len(chunk)):
                    if self._stopping.is_set():
                        return
                    handler.wfile.write(chunk)
                    self._count_sent(repo_id, len(chunk))
                return
            handler.send_header("Content-Length", str(DRIP_BYTES))
            handler.end_headers()
            handler.wfile.flush()
            for _ in range(DRIP_BYTES):
                if self._stopping.wait(DRIP_S):
                    return
                handler.wfile.write(b" ")
                handler.wfile.flush()
                self._count_sent(repo_id, 1)
        except OSError:  # the client hung up
            pass

    def _serve_endless(self, handler: BaseHTTPRequestHandler, repo_id: str, path: str, oid: str, etag: str, size: int) -> None:
        """A body that does not end: no Content-Length, bytes until the client hangs up (or ``ENDLESS_CAP``)."""
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("X-Repo-Commit", oid)
        handler.send_header("ETag", f'"{etag}"')
        if is_lfs(path):
            handler.send_header("X-Linked-Etag", f'"{etag}"')
            handler.send_header("X-Linked-Size", str(size))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        chunk, sent = b"\0" * 65536, 0
        try:
            while sent < ENDLESS_CAP and not self._stopping.is_set():
                handler.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the client hung up
            pass
        with self._lock:
            self.sent[(repo_id, path)] = self.sent.get((repo_id, path), 0) + sent


class CdnServer:
    """A CDN stand-in on another port of 127.0.0.1 (another host, for ``huggingface_hub``): every
    GET is answered with ``Content-Length: CDN_ANNOUNCED`` and zeros until the client hangs up
    (or ``ENDLESS_CAP``); ``cdn.sent[path]`` counts the bytes sent (each chunk before it is
    written: the count is there before the client reads a byte). Use as a context manager."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self._stopping = threading.Event()
        cdn = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(CDN_ANNOUNCED))
                self.end_headers()
                self.close_connection = True
                chunk, sent = b"\0" * 65536, 0
                try:
                    while sent < min(CDN_ANNOUNCED, ENDLESS_CAP) and not cdn._stopping.is_set():
                        sent += len(chunk)
                        cdn.sent[self.path] = cdn.sent.get(self.path, 0) + len(chunk)  # counted before it can arrive
                        self.wfile.write(chunk)
                except OSError:  # the client hung up
                    pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> CdnServer:
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()


@contextlib.contextmanager
def online_hub(monkeypatch, tmp_path, tokens: tuple[str, ...]):
    """A running :class:`HubServer` accepting ``tokens``, with huggingface_hub online for the test
    and no token of the machine (environment or cached login) in reach."""
    from huggingface_hub import constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    with HubServer(tokens=tokens) as server:
        yield server


def online_cli_env(hub: HubServer, token: str, hf_home: str) -> dict[str, str | None]:
    """The environment of an ``hf-pma`` process that talks to ``hub`` with ``token`` (for
    ``run_cli(..., env=..., process=True)``: huggingface_hub reads ``HF_ENDPOINT`` at import)."""
    return {
        "HF_HUB_OFFLINE": None,
        "TRANSFORMERS_OFFLINE": None,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": token,
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HOME": hf_home,
    }
