"""Read the target's token embedding and LM head straight from its safetensors files.

Only those two tensors are loaded (a Kimi-K2.5 checkpoint is ~600 GB); names are matched by
suffix so both plain (`model.embed_tokens.weight`) and multimodal (`language_model.model...`)
layouts work.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_SUFFIX = "embed_tokens.weight"
HEAD_SUFFIX = "lm_head.weight"


def _weight_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    names = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update({k: file for k in f.keys()})
    return names


def load_embed_and_head(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    files = _weight_files(Path(folder))

    def find(suffix: str) -> torch.Tensor:
        matches = sorted(n for n in files if n.endswith(suffix) and "mtp" not in n)
        if not matches:
            raise KeyError(f"{folder}: no tensor named *{suffix}")
        name = min(matches, key=len)
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    return find(EMBED_SUFFIX), find(HEAD_SUFFIX)
