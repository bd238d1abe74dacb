"""python -m eagle3_resources.fake_openrouter --port 8089 [--rate-429 0.15] [--latency 1.0] ...

Then: OPENROUTER_BASE_URL=http://127.0.0.1:8089/api/v1 OPENROUTER_API_KEY=fake-key
EAGLE3_COMPLETIONS_BACKEND=openrouter eagle3 run --datasets B6   (a rehearsal that costs nothing)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from aiohttp import web

from eagle3_resources.fake_openrouter.server import FakeOpenRouter, FakeSettings


def main(argv: list[str] | None = None) -> None:
    from eagle3_resources.storage import default_data_dir
    from eagle3_resources.tokenizer.resource import TokenizerResource

    parser = argparse.ArgumentParser(prog="python -m eagle3_resources.fake_openrouter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--tokenizer", default=None, help="Kimi tokenizer folder (default: the stand-in)")
    parser.add_argument("--log-billing", action="store_true", help="print every bill as a JSON line")
    for f in dataclasses.fields(FakeSettings):  # every setting is a flag: --rate-429 0.15, --latency-s 1 ...
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    settings = FakeSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FakeSettings)})
    tok = TokenizerResource(path=args.tokenizer, standin_dir=str(default_data_dir() / "standin")).load()
    log = (lambda bill: print(json.dumps(bill), flush=True)) if args.log_billing else None
    fake = FakeOpenRouter(tok, settings, log_billing=log)
    print(json.dumps({"listening": f"http://127.0.0.1:{args.port}/api/v1"}), flush=True)
    web.run_app(fake.app, host="127.0.0.1", port=args.port, print=None, handler_cancellation=False, backlog=4096)


if __name__ == "__main__":
    sys.exit(main())
