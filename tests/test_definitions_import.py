"""Loading the definitions imports neither torch, transformers nor safetensors.

Every Dagster process loads `eagle3_assets.definitions` (the code server, each run worker, each step process of the
multiprocess executor, the `eagle3` commands, `dagster job launch`) and no asset body runs then, so torch (~2 s) and
transformers (~0.7 s) would be paid for nothing. The asset and resource modules import the torch-using modules inside
the functions that run them (the asset body, the resource method). The test loads the definitions in a fresh Python
with `-X importtime` and, when one of them is there, names the chain of modules that imported it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors")
PACKAGES = ("eagle3_assets", "eagle3_resources")


def importers(importtime: str, module: str) -> list[str]:
    """The chain that first imported `module`, from it up to the top-level import, out of `-X importtime`'s report.

    The report lists a module after everything it imported, indented two spaces a level deeper than its importer:
    a module's importer is the next line below it that is indented less."""
    rows = []
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        name = line.split("|")[2]
        rows.append((len(name) - len(name.lstrip()), name.strip()))
    for i, (depth, name) in enumerate(rows):
        if name == module:
            chain = [name]
            for below, importer in rows[i + 1 :]:
                if below < depth:
                    chain.append(importer)
                    depth = below
            return chain
    return [module]


def test_loading_the_definitions_imports_no_torch():
    code = (
        "import json, sys\n"
        "import eagle3_assets.definitions\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    culprits = []
    for module in loaded:
        chain = importers(done.stderr, module)
        ours = [m for m in chain if m.split(".")[0] in PACKAGES]
        culprits.append(
            f"{module} imported by {ours[0] if ours else 'no eagle3 module'} (chain: {' <- '.join(chain)}); "
            "import it inside the function that runs it"
        )
    assert not loaded, "loading eagle3_assets.definitions imported " + "; ".join(culprits)
