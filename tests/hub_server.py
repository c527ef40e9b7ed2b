"""A loopback stand-in for the Hugging Face Hub, for huggingface_hub's real download and cache code.

Serves the endpoints `snapshot_download` calls (huggingface_hub 2.x):
- `GET /api/models/{repo}[/revision/{rev}]` -> model info: `sha`, `siblings` (with sizes for `?blobs=true`), `gated`;
- `GET /api/models/{repo}/tree/{sha}?recursive=...` -> the file list (`type`, `path`, `size`, `oid`);
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}` -> `X-Repo-Commit`, `ETag`, `Content-Length`, then the bytes.
Errors carry the `X-Error-Code` header huggingface_hub maps to its exceptions (RepoNotFound, GatedRepo,
RevisionNotFound, EntryNotFound). A gated repo answers files only to `Authorization: Bearer <token>`.
`hold` makes the download of `*.safetensors` stop halfway until the event is set (to watch progress).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    gated: bool = False
    token: str = "hf_test_token"


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    hold: threading.Event | None = None
    url: str = ""

    def add_dir(self, repo_id: str, directory: Path, gated: bool = False, sha: str | None = None) -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        return self.add(repo_id, files, gated=gated, sha=sha)

    def add(self, repo_id: str, files: dict[str, bytes], gated: bool = False, sha: str | None = None) -> Repo:
        digest = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode())
        self.repos[repo_id] = Repo(files=files, sha=sha or digest.hexdigest(), gated=gated)
        return self.repos[repo_id]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet test output
            pass

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            body = json.dumps({"error": code}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value: object) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, repo_id: str, rev: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
            elif rev not in ("main", repo.sha):
                self._error(404, "RevisionNotFound")
            else:
                return repo
            return None

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.requests.append(f"{self.command} {path}")
            if m := INFO.match(path):
                if repo := self._repo(m[1], m[2] or "main"):
                    blobs = "blobs=true" in url.query
                    self._json({"id": m[1], "sha": repo.sha, "gated": "manual" if repo.gated else False,
                                "siblings": [{"rfilename": n, **({"size": len(b)} if blobs else {})}
                                             for n, b in repo.files.items()]})
            elif m := TREE.match(path):
                if repo := self._repo(m[1], m[2]):
                    self._json([{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                for n, b in repo.files.items()])
            elif m := RESOLVE.match(path):
                self._file(m[1], m[2], m[3])
            else:
                self._error(404, "EntryNotFound")

        def _file(self, repo_id: str, rev: str, name: str) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(401, "GatedRepo")
            if name not in repo.files:
                return self._error(404, "EntryNotFound")
            body = repo.files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if hub.hold is not None and name.endswith(".safetensors"):
                half = len(body) // 2
                self.wfile.write(body[:half])
                self.wfile.flush()
                hub.hold.wait(120)
                body = body[half:]
            self.wfile.write(body)

    return Handler


def serve_hub(hub: Hub) -> Iterator[Hub]:
    """Run `hub` on a loopback port for the duration of the generator (use as a fixture body)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        if hub.hold is not None:
            hub.hold.set()
        server.shutdown()
        server.server_close()
