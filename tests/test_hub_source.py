"""The hub path of `resolve_files` for real: huggingface_hub against a loopback fake hub (tests/fakes/hub.py).

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when imported, so every call runs in a fresh
Python subprocess with its own environment; the fake hub runs in its own process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import free_port, port_open, stop_group, wait_for

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "HuggingFaceH4/ultrachat_200k"
TRAIN = "data/train_sft-00000-of-00001.parquet"

ROWS = [
    {
        "prompt": "What is 2+2?",
        "prompt_id": "p1",
        "messages": [{"content": "What is 2+2?", "role": "user"}, {"content": "4", "role": "assistant"}],
    },
    {
        "prompt": "Name a colour.",
        "prompt_id": "p2",
        "messages": [
            {"content": "Name a colour.", "role": "user"},
            {"content": "Teal — a blue-green.", "role": "assistant"},
        ],
    },
    {
        "prompt": "Say hi",
        "prompt_id": "p3",
        "messages": [
            {"content": "Say hi", "role": "user"},
            {"content": "hi", "role": "assistant"},
            {"content": "again", "role": "user"},
            {"content": "hi again", "role": "assistant"},
        ],
    },
]

# Prints one JSON object: the files and rows read, or the error raised (its type and message).
SNIPPET = """
import json, sys
from eagle3_resources.source_files import iter_rows, resolve_files
mode, repo, pattern = sys.argv[1:4]
try:
    files = resolve_files(repo, pattern)
    rows = [
        [r.where, r.value, r.problem]
        for name, path in files
        for r in iter_rows(name, path, ["messages", "prompt_id"], ["messages"])
    ]
    print(json.dumps({"files": [[name, str(path)] for name, path in files], "rows": rows}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def hub_env(tmp_path: Path, port: int, offline: bool = False) -> dict[str, str]:
    # Nothing of the caller's hub settings, token or proxies: only the fake hub, only loopback.
    drop = ("HF_", "HUGGING", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(drop)}
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{port}",
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        NO_PROXY="127.0.0.1,localhost",
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_snippet(env: dict[str, str], mode: str, pattern: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, mode, HUB_ID, pattern],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_hub(root: Path) -> bytes:
    repo = root / HUB_ID
    (repo / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), repo / TRAIN)
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), repo / "data/test_sft-00000-of-00001.parquet")
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# ultrachat_200k (stand-in)\n")
    return (repo / TRAIN).read_bytes()


@pytest.mark.timeout(300)
def test_resolve_files_downloads_from_the_hub_and_reads_the_cache_offline(tmp_path):
    train_bytes = build_hub(tmp_path / "hub")
    port = free_port()
    with open(tmp_path / "hub.log", "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "fakes" / "hub.py"),
                "--root",
                str(tmp_path / "hub"),
                "--port",
                str(port),
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: port_open(port), 30, "the fake hub")
        online = run_snippet(hub_env(tmp_path, port), "resolve", "data/train_sft-*.parquet")
        assert "error" not in online, online
        nothing = run_snippet(hub_env(tmp_path, port), "resolve", "data/validation-*.parquet")
    finally:
        stop_group(server)
    assert server.poll() is not None

    # Only the train_sft file was matched, downloaded into HF_HOME's cache, byte for byte.
    [[name, path]] = online["files"]
    assert name == TRAIN
    cache = tmp_path / "hf" / "hub" / "datasets--HuggingFaceH4--ultrachat_200k"
    assert Path(path).is_relative_to(cache / "snapshots") and Path(path).read_bytes() == train_bytes
    assert [p.name for p in (cache / "blobs").iterdir()] == [hashlib.sha256(train_bytes).hexdigest()]
    expected = [{"messages": r["messages"], "prompt_id": r["prompt_id"]} for r in ROWS]
    assert online["rows"] == [[f"{TRAIN}:{i}", v, None] for i, v in enumerate(expected, start=1)]

    # A glob that matches nothing is a SourceError naming the repo and the glob.
    assert nothing["error"] == "SourceError"
    assert HUB_ID in nothing["message"] and "data/validation-*.parquet" in nothing["message"]

    # Server gone, HF_HUB_OFFLINE=1: the same call reads the cached snapshot, same files, same rows.
    offline = run_snippet(hub_env(tmp_path, port, offline=True), "resolve", "data/train_sft-*.parquet")
    assert offline == online
