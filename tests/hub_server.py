"""A Hugging Face Hub served from local folders on 127.0.0.1, for tests of loading by hub id without internet.

It answers what `huggingface_hub` asks of the Hub to download files (`HF_ENDPOINT` pointed at it): a file's
metadata (HEAD) and contents (GET) at `/{repo}/resolve/{revision}/{path}`, and a repository's file list at
`/api/models/{repo}[/revision/{revision}]`. huggingface_hub ships no such server (its tests run against the real
Hub), so this is written here: about what a user's first `from_pretrained("org/model")` needs, nothing more.
Every request is recorded (`requests`), so a test can say which files were fetched.
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0" * 40  # every repository's one revision


class LocalHub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos  # "org/name" -> folder
        self.requests = []  # (method, path)
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
        return {path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/resolve/" in path}

    def _answer(self, handler, body: bool):
        path = unquote(urlparse(handler.path).path)
        self.requests.append((handler.command, path))
        if path.startswith("/api/models/"):
            name, tree, _ = path.removeprefix("/api/models/").split("/revision/")[0].partition("/tree/")
            repo = self._repo(name)
            if repo is None:
                return self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            folder = self.repos[repo]
            files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            if tree:  # list_repo_tree, which snapshot_download asks: every file, recursively
                info = [{"type": "file", "path": f, "size": (folder / f).stat().st_size,
                         "oid": hashlib.sha1((folder / f).read_bytes()).hexdigest()} for f in files]
            else:
                info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                        "siblings": [{"rfilename": f} for f in files]}
            return self._send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        repo_part, _, rest = path.lstrip("/").partition("/resolve/")
        repo = self._repo(repo_part)
        if repo is None or not rest:
            return self._send(handler, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        _revision, _, filename = rest.partition("/")
        file = self.repos[repo] / filename
        if not file.is_file():
            return self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, body)
        data = file.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        return self._send(handler, 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"',
                                               "Content-Type": "application/octet-stream"}, body)

    def _repo(self, name: str) -> str | None:
        return name if name in self.repos else None

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict, body: bool):
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
