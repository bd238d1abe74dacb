"""Each test file's measured seconds (the setup, call and teardown of its tests, from a full run), so a run hands out
the longest files first (`conftest.pytest_collection_modifyitems`) and its workers end together. Only the order
depends on it: a stale or missing entry costs time, never a result. Refresh after the suite changes much:

    .venv/bin/pytest --junitxml=/tmp/junit.xml; .venv/bin/python tests/file_seconds.py /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RECORD = Path(__file__).with_suffix(".json")


def load() -> dict[str, float]:
    """File name (`test_x.py`) -> seconds; empty when the record is missing."""
    try:
        return json.loads(RECORD.read_text())
    except FileNotFoundError:
        return {}


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per file from pytest's JUnit XML (a testcase's `time` is its setup, call and teardown)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x or tests.test_x.TestClass
        if len(parts) >= 2 and parts[1].startswith("test_"):
            name = f"{parts[1]}.py"
            seconds[name] = seconds.get(name, 0.0) + float(case.get("time") or 0.0)
    return seconds


def main(argv: list[str]) -> None:
    seconds = from_junit(Path(argv[1]))
    RECORD.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s in all -> {RECORD}")


if __name__ == "__main__":
    main(sys.argv)
