"""Stream a source through conversion, de-duplication, filters and seeded sampling.

One pass over the rows, in memory bounded by the cap: each row is converted (or rejected with its
reason), dropped if its prompt was already seen in this dataset or claimed by an earlier one, and
otherwise ranked. The filters that cost something (language detection, rendering and counting
target tokens) run only on a prompt whose rank would put it in the sample, so a 10,000-prompt
sample of a million rows measures tens of thousands of prompts, not a million; the turn filter
is free and runs on every row.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.common.registry import ImportSpec
from eagle3_assets.stages.raw_prompts.importers.schemas import CONVERTERS
from eagle3_assets.stages.raw_prompts.importers.selection import (
    language,
    prompt_key,
    sample_rank,
    user_turns,
)
from eagle3_assets.stages.raw_prompts.prompts import Prompt
from eagle3_resources.errors import InvalidPrompt
from eagle3_resources.source_files import SourceRow


@dataclass(frozen=True)
class PromptLength:
    """A prompt as the target reads it: the chat template's text, and the number of tokens of a text."""

    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
    count: Callable[[str], int]


@dataclass
class ImportReport:
    """What happened to every row of one dataset's source."""

    rows: int = 0
    rejected: int = 0
    reject_reasons: Counter = field(default_factory=Counter)
    duplicates: int = 0  # within this dataset
    duplicates_of: Counter = field(default_factory=Counter)  # earlier dataset -> prompts it already holds
    filtered: Counter = field(default_factory=Counter)  # filter -> prompts it removed
    measured: int = 0  # prompts the costly filters examined (those whose rank reached the sample)
    selected: int = 0
    cap: int | None = None

    @property
    def reject_rate(self) -> float:
        return self.rejected / self.rows if self.rows else 0.0

    def summary(self) -> str:
        dups = self.duplicates + sum(self.duplicates_of.values())
        filtered = sum(self.filtered.values())
        return (
            f"{self.rows:,} rows: {self.rejected:,} rejected ({100 * self.reject_rate:.2f}%), {dups:,} duplicates, "
            f"{filtered:,} filtered, {self.selected:,} selected" + (f" (cap {self.cap:,})" if self.cap else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "rejected": self.rejected,
            "reject_rate": round(self.reject_rate, 6),
            "reject_reasons": dict(self.reject_reasons.most_common(10)),
            "duplicates_within": self.duplicates,
            "duplicates_of_earlier": dict(self.duplicates_of),
            "filtered": dict(self.filtered),
            "measured": self.measured,
            "selected": self.selected,
            "cap": self.cap,
        }


@dataclass(order=True)
class _Ranked:
    neg_rank: int
    prompt: Prompt = field(compare=False)


ROW_DETAIL = re.compile(r"^(?:(?:message|turn|tool) \d+[^:]*: )+|\s*\(.*$")


def reason_group(message: str) -> str:
    """A reason without its row's details, for counting: `message 3: empty user content` and
    `arguments of 'f' are not valid JSON (Expecting ',' ...)` count as `empty user content` and
    `arguments of 'f' are not valid JSON`."""
    return ROW_DETAIL.sub("", message)[:100] or message[:100]


def _filtered_by(messages, tools, spec: ImportSpec, length: PromptLength) -> str | None:
    if spec.languages and language(messages) not in spec.languages:
        return "language"
    low, high = spec.min_prompt_tokens, spec.max_prompt_tokens
    if low or high:
        text = length.render(messages, tools)
        # A byte-level BPE token is at least one byte: a prompt of n bytes has at most n tokens, so
        # most prompts are inside a max bound (or under a min one) without being encoded at all.
        n_bytes = len(text.encode())
        if low and n_bytes < low:
            return "min_prompt_tokens"
        if high and n_bytes <= high and not low:
            return None
        n = length.count(text)
        if low and n < low:
            return "min_prompt_tokens"
        if high and n > high:
            return "max_prompt_tokens"
    return None


def import_prompts(
    dataset: str,
    spec: ImportSpec,
    rows: Iterable[SourceRow],
    *,
    cap: int | None,
    length: PromptLength,
    claimed: Mapping[str, str] | None = None,
    on_reject: Callable[[SourceRow, str], None] = lambda row, reason: None,
) -> tuple[list[Prompt], ImportReport]:
    """The sample of `dataset` (in sampling order) and the report of every row.

    `claimed` maps the keys of prompts earlier datasets hold to their names: a prompt there is
    not imported again. `length` renders and counts a prompt as the target reads it.
    """
    claimed = claimed or {}
    convert = CONVERTERS[spec.schema]
    report = ImportReport(cap=cap)
    seen: set[str] = set()
    heap: list[_Ranked] = []  # max-heap on rank (negated) of the current sample
    for row in rows:
        report.rows += 1
        if row.value is None:
            report.rejected += 1
            report.reject_reasons[reason_group(row.problem or "unreadable")] += 1
            on_reject(row, row.problem or "unreadable")
            continue
        try:
            conv = convert(row.value, spec)
        except InvalidPrompt as e:
            report.rejected += 1
            report.reject_reasons[reason_group(str(e))] += 1
            on_reject(row, str(e))
            continue
        key = prompt_key(conv.messages, conv.tools)
        if key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        if key in claimed:
            report.duplicates_of[claimed[key]] += 1
            continue
        turns = user_turns(conv.messages)
        if spec.min_turns and turns < spec.min_turns:
            report.filtered["min_turns"] += 1
            continue
        if spec.max_turns and turns > spec.max_turns:
            report.filtered["max_turns"] += 1
            continue
        rank = sample_rank(spec.seed, key)
        if cap is not None and len(heap) >= cap and rank >= -heap[0].neg_rank:
            continue  # outside the sample whatever the filters say: do not pay for them
        report.measured += 1
        if (why := _filtered_by(conv.messages, conv.tools, spec, length)) is not None:
            report.filtered[why] += 1
            continue
        prompt = Prompt(
            f"{dataset}-{key[:16]}",
            conv.messages,
            conv.tools,
            row.row,
            conv.dropped_turns,
            source_row=row.where,
            key=key,
            native_id=conv.native_id,
        )
        heapq.heappush(heap, _Ranked(-rank, prompt))
        if cap is not None and len(heap) > cap:
            heapq.heappop(heap)
    selected = [r.prompt for r in sorted(heap, reverse=True)]  # lowest rank first: the sampling order
    report.selected = len(selected)
    return selected, report
