"""The stand-in target's fitted weights as the project ships them (`data/standin/target.safetensors`).

The fit (`standin.fit`) runs on one thread for a minute or more, and what it gives depends on the CPU it ran on: the
same seed, data and code fitted on an AVX-512 machine and on an AVX2 one made stand-ins whose trained drafters decoded
at a real accept length of 3.88 and 2.06. So the fit runs once, here, and its result ships; a first run unpacks it
into the Hugging Face folder everything else loads (a second or two). A tokenizer or fit settings other than those it
was fitted for (another prompt corpus, a changed builder) fit on the spot, as before (`ensure_standin_target`
decides, for the target resource).

Only what the fit trains is stored: every parameter except the two vocabulary-wide matrices, and of those the rows
of the tokens the fitting text uses, plus the one row all unused tokens' head rows share (`standin.UsedRows`). The
unused embedding rows are the seeded initialisation the fit started from, rebuilt by constructing the model under
the same seed: unpacked on the machine that fitted it, the folder is bit for bit the fit's.

Regenerate after changing the builder or the prompt corpus: `python -m eagle3_resources.target.standin_weights`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_resources.errors import StandinWeightsMismatch
from eagle3_resources.storage import PROJECT_ROOT
from eagle3_resources.target.standin import (
    FIT_STEPS,
    SEED,
    build_standin_target,
    fingerprint,
    fitting_token_ids,
    new_standin_model,
    publish_standin,
)
from eagle3_resources.tokenizer.kimi import KimiTokenizer

SHIPPED = Path("data/standin/target.safetensors")
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
USED_IDS, HEAD_USED, HEAD_UNUSED, EMBED_USED = "used_ids", "lm_head.used_rows", "lm_head.unused_row", "embed.used_rows"


def pack(state: dict[str, torch.Tensor], used: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors to ship of a fitted stand-in's `state` (its `model.safetensors`, in the file's names and layout),
    `used` the fitting text's ids."""
    head, embed = state[HEAD], state[EMBED]
    unused = torch.ones(head.shape[0], dtype=torch.bool)
    unused[used] = False
    shared = head[unused][:1]
    if not bool(unused.any()) or not torch.equal(head[unused], shared.expand(int(unused.sum()), -1)):
        raise ValueError("not a fitted stand-in: the head rows of the tokens the fit never saw are not one shared row")
    out = {k: v.contiguous() for k, v in state.items() if k not in (HEAD, EMBED)}
    out[USED_IDS] = used.to(torch.int64)
    out[HEAD_USED], out[HEAD_UNUSED], out[EMBED_USED] = head[used].clone(), shared[0].clone(), embed[used].clone()
    return out


def shipped_fingerprint(path: Path) -> str:
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("fingerprint", "")


def unpack(path: Path, tokenizer: KimiTokenizer, out_dir: Path, *, expect: str) -> Path:
    """The Hugging Face folder of the shipped weights at `path` (fitted for fingerprint `expect`) in `out_dir`."""
    with safe_open(str(path), "pt") as f:
        info = dict(f.metadata() or {})
    if info.get("fingerprint") != expect:
        raise StandinWeightsMismatch(
            f"{path} was fitted for stand-in fingerprint {info.get('fingerprint')!r}, this tokenizer and builder are "
            f"{expect!r}; regenerate it: python -m eagle3_resources.target.standin_weights"
        )
    shipped = load_file(str(path))

    def fill(state: dict[str, torch.Tensor]) -> None:
        used = shipped.pop(USED_IDS)
        head, embed = state[HEAD], state[EMBED]
        head[:] = shipped.pop(HEAD_UNUSED)
        head[used] = shipped.pop(HEAD_USED)
        embed[used] = shipped.pop(EMBED_USED)
        missing, unknown = set(state) - {HEAD, EMBED} - set(shipped), set(shipped) - set(state)
        if missing or unknown:
            raise StandinWeightsMismatch(f"{path}: tensors missing {sorted(missing)}, unknown {sorted(unknown)}")
        for name, value in shipped.items():
            if state[name].shape != value.shape:
                raise StandinWeightsMismatch(
                    f"{path}: {name} is {list(value.shape)}, the model's {list(state[name].shape)}"
                )
            state[name] = value

    fit = {**json.loads(info.get("fit", "{}")), "shipped": str(path)}
    return publish_standin(new_standin_model(tokenizer), tokenizer, out_dir, fit, tensors=fill)


def ensure_standin_target(
    cache_root: Path,
    tokenizer: KimiTokenizer,
    texts: Callable[[], Iterable[str]],
    log: Callable[[str], None] = print,
    shipped: Path | None = None,
    steps: int = FIT_STEPS,
) -> Path:
    """The stand-in's folder under `cache_root`, made once: unpacked from the `shipped` weights when they were fitted
    for this tokenizer and these settings, else fitted here."""
    key = fingerprint(tokenizer.folder, steps)
    folder = Path(cache_root) / f"target-{key}"
    if (folder / "config.json").is_file():
        return folder
    if shipped is not None and Path(shipped).is_file():
        fitted_for = shipped_fingerprint(Path(shipped))
        if fitted_for == key:
            log(f"unpacking the stand-in target's shipped weights ({shipped}) to {folder}")
            return unpack(Path(shipped), tokenizer, folder, expect=key)
        log(
            f"the shipped stand-in weights ({shipped}) were fitted for another tokenizer or builder "
            f"({fitted_for or 'unknown'}, this one is {key}): fitting here"
        )
    log(f"building the stand-in target at {folder} (once; cached afterwards; {steps} fit steps)")
    return build_standin_target(folder, tokenizer, texts(), steps=steps, log=log)


def write_shipped(
    out: Path,
    tokenizer: KimiTokenizer,
    texts: Iterable[str],
    *,
    steps: int = FIT_STEPS,
    log: Callable[[str], None] = print,
) -> Path:
    """Fit the stand-in (`steps` steps) and write what ships to `out`."""
    texts = list(texts)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        folder = build_standin_target(Path(tmp) / "target", tokenizer, texts, steps=steps, log=log)
        fit = json.loads((folder / "standin.json").read_text())
        fit.pop("tokenizer", None)
        fit["fit_seconds"] = round(time.monotonic() - started, 1)
        state = load_file(str(folder / "model.safetensors"))
    tensors = pack(state, fitting_token_ids(tokenizer, texts))
    meta = {"fingerprint": fingerprint(tokenizer.folder, steps), "fit": json.dumps(fit), "torch": torch.__version__}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): fingerprint {meta['fingerprint']}, {fit}")
    return out


def main(argv: list[str] | None = None) -> None:
    from eagle3_resources.tokenizer.resource import standin_corpus_files
    from eagle3_resources.tokenizer.standin import corpus_strings, ensure_standin_tokenizer

    parser = argparse.ArgumentParser(description="Fit the stand-in target and write the weights the project ships.")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / SHIPPED)
    parser.add_argument("--corpus", default="data/prompts", help="the prompt files the stand-in tokenizer is built on")
    parser.add_argument("--steps", type=int, default=FIT_STEPS)
    args = parser.parse_args(argv)
    files = standin_corpus_files(args.corpus)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = KimiTokenizer(ensure_standin_tokenizer(Path(tmp), files))
        torch.manual_seed(SEED)
        write_shipped(args.out, tokenizer, corpus_strings(files), steps=args.steps)


if __name__ == "__main__":
    main()
