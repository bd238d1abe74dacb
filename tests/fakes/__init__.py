"""Test support: loopback stand-ins for the external systems, never shipped in the runtime packages.

- `fakes.openrouter`: a fake OpenRouter (its own tokenizer and chat template, its own bills, hostile behaviours);
  `python -m fakes.openrouter --help` with `tests/` on PYTHONPATH, also the paid-run rehearsal's (docs/paid-runs.md)
  and the benchmark's server.
- `fakes.hub`: a fake Hugging Face Hub serving a folder as dataset repos
  (`python tests/fakes/hub.py --root DIR --port N`).
- `fakes.postgres_server`: a throwaway PostgreSQL server (the `postgres_server` fixture in conftest.py).
- `fakes.sglang`: rank engines for the SGLang backend's `RankPool` (real spawned processes, no sglang).

pytest puts `tests/` on `sys.path`, so tests import them as `fakes.<name>`; processes they start get
`tests/` on PYTHONPATH.
"""
