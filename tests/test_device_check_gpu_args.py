"""benchmarks/device_check.py gives each section's script one argument list on a GPU host and another in its CPU quick
mode; the CPU run (test_readme_gpu_host.py) parses only the second. The GPU list is parsed here, by the section's
own script and parser, as the GPU host would (with `--device cuda`, the `--budget-s` of a budgeted section, `--json`),
and the script stops right after its parser returns: a misspelt or removed option fails here, not on the GPU host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from device_check import BUDGETED, HERE, SECTIONS  # noqa: E402  (the script's own list of sections)

# Runs a script as __main__ with argv, stopping (exit 0) as soon as one of its argparse parsers returns; a parse error
# exits 2 with argparse's message, as it would on the GPU host.
PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parsed(self, *args, **kwargs):
    parse(self, *args, **kwargs)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parsed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
raise SystemExit("the script ended without parsing its arguments")
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("section", list(SECTIONS))
def test_gpu_arguments_parse(section, tmp_path):
    script, gpu_args, _, _ = SECTIONS[section]
    args = [*gpu_args, "--budget-s", "60"] if section in BUDGETED else gpu_args
    argv = [str(HERE / script), "--device", "cuda", *args, "--json", str(tmp_path / "figures.json")]
    p = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, *argv], capture_output=True, text=True, timeout=500, cwd=tmp_path
    )
    assert p.returncode == 0, f"{script} {' '.join(argv[1:])}:\n{p.stderr[-2000:]}"
