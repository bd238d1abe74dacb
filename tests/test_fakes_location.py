"""The fakes are test support (tests/fakes/), not runtime code, and the paid-run rehearsal (docs/paid-runs.md, once
the README's) starts them from there.

The runtime packages are the ones pyproject ships (`[tool.setuptools.packages.find] include`); no module in them
imports `fakes` (or the fake's old home, `eagle3_resources.fake_openrouter`) or serves HTTP (aiohttp's `web`,
`http.server`): the project is a client of OpenRouter, the hub and SGLang, and their stand-ins live beside the tests.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
REHEARSAL = REPO / "docs" / "paid-runs.md"
BIN = Path(sys.executable).parent
SERVER_MODULES = ("aiohttp.web", "http.server", "socketserver")


def shipped_patterns() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]


def runtime_files() -> list[Path]:
    """Every Python file under the shipped packages' top-level folders (subfolders without __init__.py included)."""
    tops = sorted({p.split(".")[0].rstrip("*") for p in shipped_patterns()})
    return sorted(f for top in tops for f in (REPO / top).rglob("*.py"))


def fake_uses(path: Path) -> list[str]:
    """`file:line what` for each import of a fake or of an HTTP server module in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] + [f"{base}.{a.name}" if node.module else base + a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.lstrip(".").split(".")
            fake = parts[0] == "fakes" or any(p.startswith("fake") for p in parts)
            server = any(name == m or name.startswith(m + ".") for m in SERVER_MODULES)
            if fake or server:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_the_runtime_packages_hold_and_import_no_fake():
    files = runtime_files()
    assert len(files) > 50 and REPO / "eagle3_resources" / "completions" / "openrouter.py" in files, files
    shipped = find_packages(where=str(REPO), include=shipped_patterns())
    assert "eagle3_resources.completions" in shipped, shipped
    assert not [p for p in shipped if any(part.startswith("fake") for part in p.split("."))], shipped
    assert not [f for f in files if f.stem.startswith("fake")], files
    uses = [use for f in files for use in fake_uses(f)]
    assert not uses, (
        "runtime modules importing a fake or an HTTP server (test support belongs in tests/fakes/):\n" + "\n".join(uses)
    )


def rehearsal_fake_commands() -> list[str]:
    """The rehearsal's bash lines that start the fake OpenRouter, without the trailing `&` and comment."""
    text = REHEARSAL.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.partition("  # ")[0].strip()
            if "fakes.openrouter" in command or "fake_openrouter" in command:
                commands.append(command.removesuffix("&").strip())
    return commands


def test_the_rehearsal_starts_the_fake_from_tests():
    commands = rehearsal_fake_commands()
    assert commands, f"the rehearsal in {REHEARSAL.relative_to(REPO)} no longer starts the fake OpenRouter"
    for command in commands:
        # As written, from the repository root, with this interpreter's venv standing in for `.venv/bin/`; --help
        # parses every flag and exits before the server would take the port.
        line = command.replace(".venv/bin/", f"{BIN}/") + " --help"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        p = subprocess.run(line, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{command}\n{p.stdout}{p.stderr}"
        assert p.stdout.startswith("usage: python -m fakes.openrouter") and "--port" in p.stdout, p.stdout
