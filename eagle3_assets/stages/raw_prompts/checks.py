"""Checks on `raw_prompts`: how much of a source could not be converted."""

from __future__ import annotations

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.stages.raw_prompts.importers.importer import ImportReport


def reject_rate(report: ImportReport, limit: float) -> CheckOutcome:
    """The share of source rows that could not be converted stays under the dataset's `max_reject_rate`. When it
    fails: read the dataset's `<ds>.rejects.jsonl` (row, reason); fix the importer or the `import:` settings, or raise
    the limit."""
    rate = report.reject_rate
    reasons = dict(report.reject_reasons.most_common(5))
    return CheckOutcome(
        rate <= limit,
        f"{report.rejected:,} of {report.rows:,} rows rejected ({100 * rate:.2f}%, limit {100 * limit:.1f}%)"
        + (f"; most common: {next(iter(reasons))}" if reasons else ""),
        {
            "rejected": report.rejected,
            "rows": report.rows,
            "reject_rate": round(rate, 6),
            "limit": limit,
            "reasons": reasons,
        },
    )


PROMPT_CHECKS: Checks = {"reject_rate": (reject_rate, "ERROR")}
