"""The alert sink: every alert goes to the log, and to a Slack-compatible webhook when one is set.

Slack's incoming webhooks take `{"text": ...}`; the same body also carries `title` and `figures`
for receivers that want the numbers. The URL comes from `EAGLE3_ALERT_WEBHOOK_URL`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import dagster as dg
import httpx
from pydantic import Field


class AlertSink(dg.ConfigurableResource):
    webhook_url: str | None = Field(
        default=None, description="Slack-compatible incoming webhook (EAGLE3_ALERT_WEBHOOK_URL)"
    )
    timeout_s: float = Field(default=10.0, description="webhook request timeout")

    def send(self, title: str, figures: dict[str, Any], log: Callable[[str], None]) -> str:
        """Log the alert and post it; returns the alert as logged (for the logs of the runs it is about)."""
        lines = "\n".join(
            f"• {k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}" for k, v in figures.items()
        )
        text = f"*{title}*\n{lines}"
        log(f"ALERT {title}\n{lines}")
        if not self.webhook_url:
            return f"ALERT {title}\n{lines}"
        try:
            resp = httpx.post(
                self.webhook_url, json={"text": text, "title": title, "figures": figures}, timeout=self.timeout_s
            )
            resp.raise_for_status()
        except httpx.HTTPError as e:
            log(f"the alert webhook failed ({type(e).__name__}: {e}); the alert is in this log only")
            lines += "\n(the webhook failed: this alert is in the logs only)"
        return f"ALERT {title}\n{lines}"
