"""A local stand-in for the Hugging Face Hub, for `huggingface_hub` pointed at it with HF_ENDPOINT: folders served in
the Hub's URL layout (`/api/models/{repo}/revision/{rev}`, `/api/models/{repo}/tree/{rev}`,
`/{repo}/resolve/{rev}/{file}` with X-Repo-Commit, ETag and byte ranges), a gated repo that wants a token, the Hub's
X-Error-Code answers for a missing repo, revision or file, and a connection cut halfway through a file's first
download (resumed by a Range request), and a hostile endpoint: any revision resolved, and chosen commit and ETag
answers (`lies`). Loopback only."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "hf_test_token"


class Hub:
    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = (), cut: tuple[str, ...] = (),
                 any_revision: bool = False, lies: dict[str, dict[str, str]] | None = None):
        """repos: id -> folder (or a single file, served under its name); gated: ids that need TOKEN; cut: file names
        whose first full download is cut halfway; any_revision: every revision resolves (a proxy that asks no
        questions); lies: id -> {"commit"|"etag"|"sha": the value answered instead of the true one}."""
        self.repos, self.gated, self.to_cut = repos, set(gated), set(cut)
        self.any_revision, self.lies = any_revision, lies or {}
        self.ranges: list[str] = []  # the Range headers received, in order
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        if root.is_file():
            return {root.name: root}
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _error(self, status: int, code: str | None, message: str):
                payload = json.dumps({"error": message}).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _json(self, value, body: bool):
                payload = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def _repo(self, repo: str, revision: str) -> bool:
                if repo not in hub.repos:
                    self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                    return False
                if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._error(401, "GatedRepo", f"Access to model {repo} is restricted.")
                    return False
                if revision not in ("main", hub.commit(repo)) and not hub.any_revision:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return False
                return True

            def _serve(self, body: bool):
                path = self.path.split("?")[0]
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?", path)
                if api:
                    repo, kind, revision = api[1], api[2], api[3]
                    if not self._repo(repo, revision):
                        return
                    files = hub.files(repo)
                    if kind == "revision":
                        sha = hub.lies.get(repo, {}).get("sha", hub.commit(repo))
                        return self._json({"id": repo, "modelId": repo, "sha": sha, "private": False,
                                           "siblings": [{"rfilename": f} for f in files]}, body)
                    return self._json([{"type": "file", "path": f, "size": p.stat().st_size,
                                        "oid": hashlib.sha1(f.encode()).hexdigest()} for f, p in files.items()], body)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not resolve:
                    return self._error(404, None, f"no route {path}")
                repo, revision, name = resolve[1], resolve[2], resolve[3]
                if not self._repo(repo, revision):
                    return
                files = hub.files(repo)
                if name not in files:
                    return self._error(404, "EntryNotFound", f"{name} does not exist in {repo}")
                data = files[name].read_bytes()
                start = 0
                wanted = self.headers.get("Range")
                if body and wanted:
                    hub.ranges.append(wanted)
                    start = int(re.match(r"bytes=(\d+)-", wanted)[1])
                self.send_response(206 if start else 200)
                lie = hub.lies.get(repo, {})
                self.send_header("X-Repo-Commit", lie.get("commit", hub.commit(repo)))
                self.send_header("ETag", f'"{lie.get("etag", hashlib.sha256(data).hexdigest())}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return
                if name in hub.to_cut and not start:
                    hub.to_cut.discard(name)
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # cut: the client sees fewer bytes than promised
                    return
                self.wfile.write(data[start:])

        return Handler
