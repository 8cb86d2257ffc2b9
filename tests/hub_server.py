"""A Hugging Face Hub served from local folders on 127.0.0.1, for tests of loading and downloading by hub id
without internet.

It answers what `huggingface_hub` asks of the Hub to download files (`HF_ENDPOINT` pointed at it): a file's
metadata (HEAD) and contents (GET, whole or from a byte offset: `Range`) at `/{repo}/resolve/{revision}/{path}`,
a repository's info at `/api/models/{repo}[/revision/{revision}]` and its file list at
`/api/models/{repo}/tree/{revision}[/{folder}]`, with the Hub's error answers (`X-Error-Code`). A dataset
repository is named `datasets/ORG/NAME` (its files at `/datasets/ORG/NAME/resolve/...`, its info at
`/api/datasets/ORG/NAME...`, as the Hub serves them); a `Range` of `bytes=START-END` gets those bytes alone. huggingface_hub ships no such
server (its tests run against the real Hub), so this is written here: what a user's downloads need, nothing more.

A repository is a folder (its one revision, `main`) or {revision: folder} (branches or tags; each revision gets a
commit hash, which also names it). Every request is recorded (`requests`), so a test can say which files were
fetched; and a test can make the Hub misbehave: gate a repository (`gated`), accept only some tokens (`tokens`),
answer every request with an error (`failing`, with `failing_message`), list files it then answers 404 for
(`gone`: deleted after the listing), or cut a file's first download after some bytes (`cut_once`).
"""

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0" * 40  # the commit of `main`


@dataclass
class Request:
    method: str
    path: str
    headers: dict = field(default_factory=dict)  # Range and Authorization, where sent

    def __iter__(self):  # (method, path), as requests were once recorded
        return iter((self.method, self.path))

    def __eq__(self, other):
        return tuple(self) == tuple(other) if isinstance(other, tuple) else NotImplemented


def commit_of(revision: str) -> str:
    return COMMIT if revision == "main" else hashlib.sha1(revision.encode()).hexdigest()


class LocalHub:
    def __init__(self, repos: dict[str, Path | dict[str, Path]]):
        self.repos = {name: repo if isinstance(repo, dict) else {"main": repo} for name, repo in repos.items()}
        self.requests: list[Request] = []
        self.gated: set[str] = set()  # repositories whose files need a token of `tokens`
        self.tokens: set[str] | None = None  # the valid tokens (None: any token is valid)
        self.failing: int | None = None  # a status every request is answered with (500: the Hub is down)
        self.failing_message = "failing"  # its X-Error-Message ("Access to this resource is disabled.": 403's)
        self.gone: set[str] = set()  # file names listed by the API, then 404 EntryNotFound when fetched
        self.cut_once: dict[str, int] = {}  # file name -> bytes sent before its first GET is cut
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """Files whose contents were downloaded (GET of a file)."""
        return {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in self.requests
                if r.method == "GET" and "/resolve/" in r.path}

    def downloads(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path]

    # -- answers -----------------------------------------------------------------------------------
    def _answer(self, handler, body: bool):
        url = urlparse(handler.path)
        path = unquote(url.path)
        headers = {k: handler.headers[k] for k in ("Range", "Authorization") if handler.headers.get(k)}
        self.requests.append(Request(handler.command, path, headers))
        if self.failing is not None:
            return self._send(handler, self.failing, b'{"error": "failing"}',
                              {"Retry-After": "0", "X-Error-Message": self.failing_message}, body)
        token = headers.get("Authorization", "").removeprefix("Bearer ")
        if token and self.tokens is not None and token not in self.tokens:
            return self._send(handler, 401, b"", {"X-Error-Message": "Invalid credentials in Authorization header"},
                              body)
        if path.startswith("/api/models/"):
            return self._api(handler, path.removeprefix("/api/models/"), parse_qs(url.query), body)
        if path.startswith("/api/datasets/"):
            return self._api(handler, "datasets/" + path.removeprefix("/api/datasets/"), parse_qs(url.query), body)
        repo, _, rest = path.lstrip("/").partition("/resolve/")
        if repo not in self.repos or not rest:
            return self._send(handler, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        revision, _, filename = rest.partition("/")
        folder, commit = self._revision(repo, revision)
        if folder is None:
            return self._send(handler, 404, b"", {"X-Error-Code": "RevisionNotFound"}, body)
        if repo in self.gated and not (token and (self.tokens is None or token in self.tokens)):
            return self._send(handler, 401, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"}, body)
        file = folder / filename
        if not file.is_file() or filename in self.gone:
            return self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, body)
        return self._file(handler, file, filename, commit, headers.get("Range"), body)

    def _api(self, handler, rest: str, query: dict, body: bool):
        rest, tree, tree_rest = rest.partition("/tree/")
        name, _, revision = rest.partition("/revision/")
        if name.startswith("datasets/") and name.count("/") > 2:  # datasets/ORG/NAME/ORG/... is no name
            name = "/".join(name.split("/")[:3])
        if name not in self.repos:
            return self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"},
                              body)
        revision = (tree_rest.split("/", 1)[0] if tree else revision) or "main"
        folder, commit = self._revision(name, revision)
        if folder is None:
            return self._send(handler, 404, b'{"error": "Revision not found"}', {"X-Error-Code": "RevisionNotFound"},
                              body)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        if tree:  # list_repo_tree: every file when recursive, else the folder's files and folders
            under = tree_rest.partition("/")[2].strip("/")
            prefix = f"{under}/" if under else ""
            inside = [f.removeprefix(prefix) for f in files if f.startswith(prefix)]
            if under and not inside:  # the Hub's answer for a folder it does not have
                return self._send(handler, 404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"}, body)
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            listed = inside if recursive else [f for f in inside if "/" not in f]
            info = [{"type": "file", "path": prefix + f, "size": (folder / prefix / f).stat().st_size,
                     "oid": hashlib.sha1((folder / prefix / f).read_bytes()).hexdigest()} for f in listed]
            if not recursive:
                info += [{"type": "directory", "path": prefix + d, "oid": COMMIT}
                         for d in sorted({f.split("/", 1)[0] for f in inside if "/" in f})]
        else:
            repo_id = name.removeprefix("datasets/")
            info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": name in self.gated,
                    "siblings": [{"rfilename": f, "size": (folder / f).stat().st_size} for f in files]}
        return self._send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _revision(self, repo: str, revision: str) -> tuple[Path | None, str]:
        for name, folder in self.repos[repo].items():
            if revision in (name, commit_of(name)):
                return folder, commit_of(name)
        return None, ""

    def _file(self, handler, file: Path, filename: str, commit: str, range_: str | None, body: bool):
        data = file.read_bytes()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if range_ and range_.startswith("bytes="):
            first, _, last = range_.removeprefix("bytes=").partition("-")
            start, stop = int(first), min(len(data), int(last) + 1) if last else len(data)
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            return self._send(handler, 206, data[start:stop], headers, body)
        if body and filename in self.cut_once:  # the connection drops mid-file, this once
            sent = self.cut_once.pop(filename)
            handler.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(data[:sent])
            handler.wfile.flush()
            handler.close_connection = True
            return
        return self._send(handler, 200, data, headers, body)

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict, body: bool):
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
