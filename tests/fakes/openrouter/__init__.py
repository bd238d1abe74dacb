"""A fake OpenRouter server on loopback (tests, the benchmark, and rehearsing a run before paying).

It imports nothing from the rest of the project: its token counts and prompt rendering are its
own, so comparing the project's reconstruction with its bill is a real check.
"""

from fakes.openrouter.server import (
    Bill,
    Billing,
    FakeOpenRouter,
    FakeSettings,
    Generated,
    RequestInfo,
)
from fakes.openrouter.thread import ServerThread

__all__ = ["Bill", "Billing", "FakeOpenRouter", "FakeSettings", "Generated", "RequestInfo", "ServerThread"]
