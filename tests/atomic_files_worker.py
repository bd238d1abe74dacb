"""A writer of published folders, killed or held at chosen moments, for tests/test_atomic_files.py.

python tests/atomic_files_worker.py export-killed-mid-write OUT   # exports a drafter, SIGKILLed inside save_file
python tests/atomic_files_worker.py killed-between-renames OUT    # publishes OUT by two renames (a file system
                                                                  # without RENAME_EXCHANGE), SIGKILLed after moving
                                                                  # the old OUT aside, before renaming the new one in
python tests/atomic_files_worker.py hold OUT                      # stages OUT, says "staged", waits for stdin's end
python tests/atomic_files_worker.py held-between-renames OUT      # as above, but says "between" and waits for
                                                                  # stdin's end instead of dying
python tests/atomic_files_worker.py scratch-killed DIR/PURPOSE    # SIGKILLed with a file in a scratch folder
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from test_drafter import tiny_drafter

from eagle3_assets.stages.eagle3_drafter import export
from eagle3_resources import atomic_files


def die(*_: object, **__: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def two_renames(a: Path, b: Path) -> bool:
    return False  # as on a file system without RENAME_EXCHANGE: the swap is two renames


def main(mode: str, out: Path) -> None:
    if mode == "export-killed-mid-write":
        real_save = export.save_file

        def save_then_die(tensors: dict[str, Any], filename: Any, metadata: dict[str, str] | None = None) -> None:
            real_save(tensors, filename, metadata)  # then the weights half written: the worst moment for a reader
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            die()

        export.save_file = save_then_die
        export.export_checkpoint(tiny_drafter(), out, [1, 2, 3])
    elif mode == "killed-between-renames":
        atomic_files.exchange = two_renames
        real_rename = os.rename

        def rename(src: Any, dst: Any) -> None:
            if Path(src).name.startswith(f".{out.name}.staging~"):
                die()  # the previous OUT is already moved aside
            real_rename(src, dst)

        os.rename = rename  # type: ignore[assignment]  # this throwaway process's os module: atomic_files calls it
        with atomic_files.published_folder(out) as tmp:
            (tmp / "version").write_text("new")
    elif mode == "held-between-renames":
        atomic_files.exchange = two_renames
        real_rename = os.rename

        def held_rename(src: Any, dst: Any) -> None:
            if Path(src).name.startswith(f".{out.name}.staging~"):
                print("between", flush=True)  # the previous OUT is moved aside
                sys.stdin.read()
            real_rename(src, dst)

        os.rename = held_rename  # type: ignore[assignment]  # this throwaway process's os module: atomic_files calls it
        with atomic_files.published_folder(out) as tmp:
            (tmp / "version").write_text("new")
    elif mode == "scratch-killed":
        with atomic_files.scratch_folder(out.parent, out.name) as work:
            (work / "w0.bin").write_bytes(bytes(2**20))
            die()
    elif mode == "hold":
        with atomic_files.published_folder(out) as tmp:
            (tmp / "version").write_text("held")
            print("staged", flush=True)
            sys.stdin.read()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
