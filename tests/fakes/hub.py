"""A loopback stand-in for the Hugging Face Hub: serves a folder as dataset repos, for tests.

`ROOT/<org>/<name>/...` is the dataset repo `<org>/<name>`, at any revision. It implements only what
`snapshot_download(repo, repo_type="dataset", allow_patterns=...)` (and `list_repo_files`,
`hf_hub_download`) ask of the hub, as read in huggingface_hub 2.4.0:

- GET  /api/datasets/<org>/<name>/revision/<revision>  the repo's info: {"id", "sha", "siblings"}; the
  client resolves the revision to this commit sha, then lists the tree and downloads at that sha.
- GET  /api/datasets/<org>/<name>/tree/<revision>[/<path>]?recursive=..&expand=..
  one JSON page (no `Link: rel="next"` header, so no pagination) of
  {"type": "file"|"directory", "path", "oid", "size"} entries, files only under `recursive`.
- HEAD /datasets/<org>/<name>/resolve/<revision>/<path>  the file's metadata, answered directly (200, no
  redirect): `X-Repo-Commit` (required, else FileMetadataError), `ETag` (required; the sha256 of the file,
  which the client uses as the blob name in its cache) and `Content-Length` (the client checks the size).
- GET  on the same URL: the file's bytes with the same headers; `Range: bytes=N-` (a resumed download) gets a 206.

No `X-Xet-Hash` / `X-Xet-Refresh-Route` header is ever sent, so the client downloads over plain HTTP and
never talks xet. Errors carry the hub's `X-Error-Code` (RepoNotFound, EntryNotFound) so the client raises
its usual typed errors. The commit sha is 40 hex chars derived from the repo's files: stable while they are.

Run: python tests/fakes/hub.py --root DIR --port N   (or import `make_app(root)`).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from aiohttp import web


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(repo_dir: Path) -> list[Path]:
    return sorted(p for p in repo_dir.rglob("*") if p.is_file())


def _commit(repo_dir: Path) -> str:
    h = hashlib.sha1()
    for p in _files(repo_dir):
        h.update(f"{p.relative_to(repo_dir).as_posix()}\0{_sha256(p)}\n".encode())
    return h.hexdigest()


def _error(status: int, code: str, message: str, commit: str | None = None) -> web.Response:
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if commit:
        headers["X-Repo-Commit"] = commit
    return web.json_response({"error": message}, status=status, headers=headers)


def make_app(root: str | Path) -> web.Application:
    root = Path(root).resolve()

    def repo_dir(request: web.Request) -> Path | None:
        d = (root / request.match_info["org"] / request.match_info["name"]).resolve()
        return d if d.is_relative_to(root) and d.is_dir() else None

    async def tree(request: web.Request) -> web.Response:
        repo = repo_dir(request)
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        sub = request.match_info["path"].lstrip("/")
        base = (repo / sub).resolve()
        if not base.is_relative_to(repo) or not base.is_dir():
            return _error(404, "EntryNotFound", f"{sub} does not exist")
        recursive = request.query.get("recursive", "false").lower() in ("true", "1")
        entries = []
        for p in sorted(base.rglob("*") if recursive else base.iterdir()):
            rel = p.relative_to(repo).as_posix()
            if p.is_file():
                data = p.read_bytes()  # oid: the git blob sha1, as the hub gives
                entries.append(
                    {
                        "type": "file",
                        "path": rel,
                        "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                        "size": len(data),
                    }
                )
            elif p.is_dir():
                entries.append(
                    {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest(), "size": 0}
                )
        return web.json_response(entries)

    async def info(request: web.Request) -> web.Response:
        repo = repo_dir(request)
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        name = f"{request.match_info['org']}/{request.match_info['name']}"
        siblings = [{"rfilename": p.relative_to(repo).as_posix()} for p in _files(repo)]
        return web.json_response({"id": name, "sha": _commit(repo), "private": False, "siblings": siblings})

    async def resolve(request: web.Request) -> web.StreamResponse:
        repo = repo_dir(request)
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        commit = _commit(repo)
        path = (repo / request.match_info["path"]).resolve()
        if not path.is_relative_to(repo) or not path.is_file():
            return _error(404, "EntryNotFound", f"{request.match_info['path']} does not exist", commit)
        data = path.read_bytes()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        start = request.http_range.start if request.method == "GET" else None  # a resumed download: `bytes=N-`
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return web.Response(status=206, body=data[start:], headers=headers)
        return web.Response(body=data, headers=headers)  # aiohttp sends Content-Length, and no body on HEAD

    app = web.Application()
    app.router.add_get("/api/datasets/{org}/{name}/revision/{revision}", info)
    app.router.add_get("/api/datasets/{org}/{name}/tree/{revision}{path:.*}", tree)
    app.router.add_get("/datasets/{org}/{name}/resolve/{revision}/{path:.+}", resolve)  # GET and HEAD
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.root), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
