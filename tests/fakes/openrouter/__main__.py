"""PYTHONPATH=tests python -m fakes.openrouter --port 8089 [--rate-429 0.15] [--latency-s 1.0] ...

Every FakeSettings field is a flag (`--late-bill-s 5`, `--max-rps 20`, `--template-version k2`,
`--endpoints '[{"provider_name": "A", "quantization": "int4", "price_prompt": 6e-7, ...}]'`,
booleans as `--thinking false`).

Then: OPENROUTER_BASE_URL=http://127.0.0.1:8089/api/v1 OPENROUTER_API_KEY=fake-key
EAGLE3_COMPLETIONS_BACKEND=openrouter eagle3 run --datasets B6   (a rehearsal that costs nothing)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from aiohttp import web

from fakes.openrouter.server import FakeOpenRouter, FakeSettings


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, FakeSettings]:
    parser = argparse.ArgumentParser(
        prog="python -m fakes.openrouter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--tokenizer", default=None, help="Kimi tokenizer folder (default: the stand-in)")
    parser.add_argument("--log-billing", action="store_true", help="print every bill as a JSON line")
    for f in dataclasses.fields(FakeSettings):  # every setting is a flag: --rate-429 0.15, --latency-s 1 ...
        kind = _bool if isinstance(f.default, bool) else type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = parser.parse_args(argv)
    return args, FakeSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FakeSettings)})


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    folder = args.tokenizer
    if folder is None:  # only to find (or build) the stand-in tokenizer's folder; the fake counts on its own
        from eagle3_resources.storage import default_data_dir
        from eagle3_resources.tokenizer.resource import TokenizerResource

        folder = TokenizerResource(standin_dir=str(default_data_dir() / "standin")).folder()
    log = (lambda bill: print(json.dumps(bill), flush=True)) if args.log_billing else None
    fake = FakeOpenRouter(folder, settings, log_billing=log)
    print(json.dumps({"listening": f"http://127.0.0.1:{args.port}/api/v1"}), flush=True)
    web.run_app(fake.app, host="127.0.0.1", port=args.port, print=None, handler_cancellation=False, backlog=4096)


if __name__ == "__main__":
    main()
