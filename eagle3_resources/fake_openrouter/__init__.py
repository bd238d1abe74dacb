"""A fake OpenRouter server on loopback (tests, the benchmark, and rehearsing a run before paying)."""

from eagle3_resources.fake_openrouter.server import (
    Bill,
    Billing,
    FakeOpenRouter,
    FakeSettings,
)
from eagle3_resources.fake_openrouter.thread import ServerThread

__all__ = ["Bill", "Billing", "FakeOpenRouter", "FakeSettings", "ServerThread"]
