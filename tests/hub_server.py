"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for push tests without the internet.

It answers, over real HTTP, the endpoints that ``huggingface_hub`` 2.4 calls for
``HfApi.create_repo``, ``create_branch``, ``repo_info`` and ``upload_folder`` (with or without
``hf_xet``):

* ``POST /api/repos/create``                       -> ``{"url": ...}`` (409 when it exists)
* ``GET  /api/models/{repo}[/revision/{rev}]``     -> repo info (``id``, ``sha``, ``siblings``)
* ``GET  /api/models/{repo}/refs``                 -> branches
* ``POST /api/models/{repo}/branch/{branch}``      -> creates a branch from main (409 if it exists)
* ``POST /api/models/{repo}/preupload/{rev}``      -> ``uploadMode: "regular"`` for every file
* ``POST /api/models/{repo}/commit/{rev}``         -> NDJSON: header line, then files in base64
* ``POST /api/validate-yaml``                      -> no errors (used without ``hf_xet``)

Received files are kept per repo and branch (``server.files(repo_id, branch)``) so tests can
compare bytes, and every request is logged (``server.requests``). ``server.fail_status`` makes
every API request answer that status (401, 403, ...); ``server.fail_on`` limits it to
endpoints whose kind is listed ("create", "preupload", "commit", ...). Only tokens in
``server.tokens`` are accepted (401 otherwise).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

USER = "tester"
_REPO_API = re.compile(
    r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+(?:/[^/]+)??)"
    r"(?:/(?P<kind>preupload|commit|branch|revision|refs)(?:/(?P<rev>.+))?)?$"
)


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob, as the Hub reports for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repo:
    def __init__(self, repo_id: str, private: bool) -> None:
        self.repo_id = repo_id
        self.private = private
        self.branches: dict[str, dict[str, bytes]] = {"main": {}}
        self.heads: dict[str, str] = {"main": hashlib.sha1(repo_id.encode()).hexdigest()}
        self.commits: list[dict[str, Any]] = []


class HubServer:
    """The server and what it received. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(self, tokens: tuple[str, ...] = ("hf_test_token_for_the_local_hub_0000",)) -> None:
        self.tokens = set(tokens)
        self.repos: dict[str, _Repo] = {}
        self.requests: list[dict[str, Any]] = []
        self.fail_status: int | None = None
        self.fail_on: set[str] | None = None
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """The endpoint to give ``HfApi(endpoint=...)`` or ``HF_ENDPOINT``."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
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

    # ------------------------------------------------------------ handler

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:  # noqa: N802
                server._dispatch(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                server._dispatch(self, "POST")

            def do_HEAD(self) -> None:  # noqa: N802
                server._dispatch(self, "HEAD")

        return Handler

    def _reply(self, handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if status >= 400 and isinstance(body, dict) and "error" in body:
            handler.send_header("X-Error-Message", body["error"])
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def _dispatch(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(handler.path).path
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        auth = handler.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        match = _REPO_API.match(path)
        if path == "/api/repos/create":
            kind = "create"
        elif path == "/api/validate-yaml":
            kind = "validate-yaml"
        elif match:
            kind = match.group("kind") or "info"
        else:
            kind = "unknown"
        record = {"method": method, "path": path, "kind": kind, "has_token": token is not None, "bytes": len(body)}
        with self._lock:
            self.requests.append(record)
        if self.fail_status is not None and (self.fail_on is None or kind in self.fail_on):
            self._reply(handler, self.fail_status, {"error": f"refused by the test Hub ({self.fail_status})"})
            return
        if token not in self.tokens:
            self._reply(handler, 401, {"error": "Invalid credentials in Authorization header"})
            return
        with self._lock:
            try:
                status, answer = self._handle(method, kind, match, path, body)
            except Exception as err:  # a bug here should show up as a clear HTTP error in the test
                status, answer = 500, {"error": f"test Hub failed: {err!r}"}
        self._reply(handler, status, answer)

    def _handle(self, method: str, kind: str, match: re.Match | None, path: str, body: bytes) -> tuple[int, Any]:
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
            return 404, {"error": "Repository not found"}
        rev = unquote(match.group("rev") or "main")
        if kind in ("info", "revision") and method in ("GET", "HEAD"):
            if rev not in repo.branches:
                return 404, {"error": f"Invalid rev id: {rev}"}
            siblings = [{"rfilename": name} for name in sorted(repo.branches[rev])]
            return 200, {"id": repo.repo_id, "sha": repo.heads[rev], "private": repo.private, "siblings": siblings}
        if kind == "refs":
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": repo.heads[b]} for b in repo.branches]
            return 200, {"branches": branches, "converts": [], "tags": []}
        if kind == "branch" and method == "POST":
            if rev in repo.branches:
                return 409, {"error": f"Reference already exists: refs/heads/{rev}"}
            repo.branches[rev] = dict(repo.branches["main"])
            repo.heads[rev] = repo.heads["main"]
            return 200, {}
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
        repo.branches[rev] = tree
        repo.heads[rev] = oid
        repo.commits.append({"branch": rev, "oid": oid, "summary": header.get("summary"), "files": sorted(tree)})
        return 200, {"commitUrl": f"{self.url}/{repo.repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
