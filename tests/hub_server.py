"""A loopback server that answers the Hugging Face Hub's HTTP API as the Hub does, for the hf-hub: and push tests
(HF_ENDPOINT pointed at it; never the real Hub). Each answer follows what huggingface_hub reads of the Hub's: its
status, the X-Error-Code / X-Error-Message headers of a failure, X-Repo-Commit and ETag on a file, the Link header of
a paged listing. Every request is recorded (method, path, headers, body) for the tests to assert what was sent.

    GET  /api/models/ORG/NAME[/revision/REV]      the repository at REV (main): {"id", "sha", "siblings"}
    GET  /api/models/ORG/NAME/tree/REV            its top folder's files, 1,000 a page (Link: rel="next")
    HEAD/GET /ORG/NAME/resolve/REV/FILE           a file: X-Repo-Commit, ETag, Content-Length, the bytes
    POST /api/repos/create                        a repository (409 when it exists)
    POST /api/validate-yaml                       the README.md's metadata
    POST /api/models/ORG/NAME/preupload/REV       each file's upload mode: "lfs" for *.safetensors, else "regular"
    POST /ORG/NAME.git/info/lfs/objects/batch     where to PUT each LFS object ...
    PUT  /lfs/OID                                 ... its bytes (their SHA-256 must be OID)
    POST /api/models/ORG/NAME/commit/REV          the commit (NDJSON: header, file, lfsFile): {"commitOid", ...}

A private repository is read with an accepted token only: without one the answer is 401 RepoNotFound, as for a
repository that does not exist; a token that is not accepted is 401 "Invalid credentials in Authorization header".
Writes need an accepted token.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import urllib.parse
from dataclasses import dataclass, field

PAGE = 1000  # entries of a tree page, as the Hub pages them


@dataclass
class Repo:
    private: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    extra_listing: int = 0  # entries listed beside the files (a hostile repository's huge file list)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class FakeHub:
    def __init__(self, tokens: tuple[str, ...] = ("hf_accepted",)) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.lfs: dict[str, bytes] = {}  # uploaded LFS objects: sha256 -> bytes
        self.tokens = set(tokens)
        self._lock = threading.Lock()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                request = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with hub._lock:
                    hub.requests.append(request)
                    status, headers, payload = hub.answer(request, f"http://{self.headers['Host']}")
                self.send_response(status)
                for key, value in {"Content-Length": str(len(payload)), **headers}.items():
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_HEAD = do_POST = do_PUT = _handle

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ----------------------------------------------------------------------------------------------- state
    def add_repo(self, repo_id: str, files: dict[str, bytes], *, private: bool = False, extra_listing: int = 0) -> str:
        """A repository holding `files` on its main branch; returns the commit."""
        self.repos[repo_id] = Repo(private=private, extra_listing=extra_listing)
        return self.commit(repo_id, "main", files)

    def commit(self, repo_id: str, branch: str, files: dict[str, bytes]) -> str:
        """A new commit on `branch` whose files are the branch's with `files` added; returns its hash."""
        repo = self.repos[repo_id]
        tree = {**repo.commits.get(repo.refs.get(branch, ""), {}), **files}
        digest = hashlib.sha1(
            repr((repo.refs.get(branch), sorted((k, _sha256(v)) for k, v in tree.items()))).encode()
        ).hexdigest()
        repo.commits[digest] = tree
        repo.refs[branch] = digest
        return digest

    def sent(self, method: str, fragment: str) -> list[Request]:
        """The requests of `method` whose path holds `fragment`."""
        return [r for r in self.requests if r.method == method and fragment in r.path]

    # ----------------------------------------------------------------------------------------------- answers
    def answer(self, request: Request, base: str) -> tuple[int, dict[str, str], bytes]:
        split = urllib.parse.urlsplit(request.path)
        parts = [urllib.parse.unquote(p) for p in split.path.strip("/").split("/")]
        query = urllib.parse.parse_qs(split.query)
        token = request.headers.get("authorization", "").removeprefix("Bearer ") or None
        if token is not None and token not in self.tokens:
            return _error(401, "Invalid credentials in Authorization header")
        if parts[:2] == ["api", "agent-harnesses"]:  # (huggingface_hub's user-agent registry: none here)
            return _error(404, "Not found")
        if request.method == "PUT" and parts[0] == "lfs":
            return self._lfs_put(parts[1], request.body)
        if parts[:2] == ["api", "validate-yaml"]:
            return _json({"errors": [], "warnings": []})
        if parts[:3] == ["api", "repos", "create"]:
            return self._create(json.loads(request.body), token, base)
        if len(parts) >= 2 and parts[1].endswith(".git"):  # ORG/NAME.git/info/lfs/objects/batch
            return self._lfs_batch(f"{parts[0]}/{parts[1].removesuffix('.git')}", json.loads(request.body), token, base)
        if parts[:2] == ["api", "models"] and len(parts) in (4, 6, 7):  # (/api/models/ORG/NAME: the default branch)
            repo_id, action, revision = (
                f"{parts[2]}/{parts[3]}",
                *(parts[4:6] if len(parts) > 4 else ("revision", "main")),
            )
            refused = self._refuse(repo_id, token, write=action in ("preupload", "commit"))
            if refused:
                return refused
            if action == "preupload":
                return self._preupload(json.loads(request.body))
            if action == "commit":
                return self._commit(repo_id, revision, request.body, base)
            commit = self._resolve(repo_id, revision)
            if commit is None:
                return _error(404, "Invalid rev id", code="RevisionNotFound")
            if action == "revision":
                files = self.repos[repo_id].commits[commit]
                return _json(
                    {
                        "id": repo_id,
                        "sha": commit,
                        "private": self.repos[repo_id].private,
                        "siblings": [{"rfilename": name} for name in files],
                    }
                )
            if action == "tree":
                return self._tree(repo_id, commit, int((query.get("cursor") or ["0"])[0]), base, split.path)
        if len(parts) >= 5 and parts[2] == "resolve":  # ORG/NAME/resolve/REV/FILE
            return self._resolve_file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), token)
        return _error(404, "no such route")

    def _refuse(self, repo_id: str, token: str | None, *, write: bool = False):
        """The Hub's answer to a request the token may not make on `repo_id`; None when it may."""
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token is None):
            return _error(401 if token is None else 404, "Repository not found", code="RepoNotFound")
        if write and token is None:
            return _error(401, "You must be authenticated to write")
        return None

    def _resolve(self, repo_id: str, revision: str) -> str | None:
        repo = self.repos[repo_id]
        return revision if revision in repo.commits else repo.refs.get(revision)

    def _resolve_file(self, repo_id: str, revision: str, path: str, token: str | None):
        refused = self._refuse(repo_id, token)
        if refused:
            return refused
        commit = self._resolve(repo_id, revision)
        if commit is None:
            return _error(404, "Invalid rev id", code="RevisionNotFound")
        body = self.repos[repo_id].commits[commit].get(path)
        if body is None:
            status, headers, payload = _error(404, "Entry not found", code="EntryNotFound")
            return status, {**headers, "X-Repo-Commit": commit}, payload
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{_sha256(body)}"'}, body

    def _tree(self, repo_id: str, commit: str, cursor: int, base: str, path: str):
        repo = self.repos[repo_id]
        entries = [
            {"type": "file", "path": name, "size": len(body), "oid": hashlib.sha1(body).hexdigest()}
            for name, body in sorted(repo.commits[commit].items())
        ]
        total = len(entries) + repo.extra_listing
        page = [
            *entries,
            *(
                {"type": "file", "path": f"junk/{i:07d}.bin", "size": 1, "oid": "0" * 40}
                for i in range(repo.extra_listing)
            ),
        ][cursor : cursor + PAGE]
        headers = {"Content-Type": "application/json"}
        if cursor + PAGE < total:
            headers["Link"] = f'<{base}{path}?cursor={cursor + PAGE}>; rel="next"'
        return 200, headers, json.dumps(page).encode()

    def _create(self, payload: dict, token: str | None, base: str):
        if token is None:
            return _error(401, "You must be authenticated to create a repository")
        repo_id = f"{payload['organization']}/{payload['name']}"
        if repo_id in self.repos:
            return _json({"error": "You already created this model repo", "url": f"{base}/{repo_id}"}, status=409)
        self.add_repo(
            repo_id,
            {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
            private=payload.get("visibility") == "private",
        )
        return _json({"url": f"{base}/{repo_id}", "name": repo_id, "id": repo_id})

    def _preupload(self, payload: dict):
        files = [
            {
                "path": f["path"],
                "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                "shouldIgnore": False,
                "oid": None,
            }
            for f in payload["files"]
        ]
        return _json({"files": files})

    def _lfs_batch(self, repo_id: str, payload: dict, token: str | None, base: str):
        refused = self._refuse(repo_id, token, write=True)
        if refused:
            return refused
        objects = [
            {
                "oid": o["oid"],
                "size": o["size"],
                "authenticated": True,
                **({} if o["oid"] in self.lfs else {"actions": {"upload": {"href": f"{base}/lfs/{o['oid']}"}}}),
            }
            for o in payload["objects"]
        ]
        return _json({"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str, body: bytes):
        if _sha256(body) != oid:
            return _error(400, "the object's bytes do not have its oid")
        self.lfs[oid] = body
        return 200, {}, b""

    def _commit(self, repo_id: str, revision: str, body: bytes, base: str):
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files: dict[str, bytes] = {}
        for line in lines[1:]:  # (the first is the header: the commit's summary)
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return _error(422, f"LFS object {value['oid']} was not uploaded")
                files[value["path"]] = self.lfs[value["oid"]]
        commit = self.commit(repo_id, revision, files)
        return _json(
            {
                "commitUrl": f"{base}/{repo_id}/commit/{commit}",
                "commitOid": commit,
                "pullRequestUrl": None,
                "success": True,
            }
        )


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _json(value, status: int = 200) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _error(status: int, message: str, *, code: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "X-Error-Message": message}
    if code is not None:
        headers["X-Error-Code"] = code
    return status, headers, json.dumps({"error": message}).encode()


__all__ = ["FakeHub", "Repo", "Request"]
