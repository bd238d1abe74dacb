"""Exact target token ids for every completion: the logic behind the `token_ids` asset.

A training sample is `prompt_ids + completion_ids` with a loss mask over the completion.
`prompt_ids` are the chat-format rendering sent (or that the provider rendered from the same
messages). `completion_ids` are, for K2.5 with thinking on:

    enc(reasoning) + [</think>] + enc(content) [+ tool-call section] + [<|im_end|>]

Free text is encoded with special tokens NOT allowed (a model quoting "</think>" in prose wrote
ordinary tokens), except the tool-call markers, which come back as raw text in `content` but
were generated as single special tokens. A `length` finish has no `<|im_end|>`, and when it cut
the reasoning (empty content) no `</think>` either. Where the backend returned ids (local,
SGLang) those ids are kept, and the reconstruction from text is checked against them.

Every row carries its proof: separator count, end token, and the differences between the
reconstructed and the billed token counts.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import (
    IM_END,
    THINK_END,
    TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALL_MARKERS,
    TOOL_CALLS_SECTION_BEGIN,
    TOOL_CALLS_SECTION_END,
)

USABLE_STATUSES = ("ok", "truncated")


def tool_calls_ids(tokenizer: KimiTokenizer, tool_calls: list[dict[str, Any]]) -> list[int]:
    """Ids of a tool-call section from an API's structured `tool_calls`."""
    ids = [tokenizer.token_id(TOOL_CALLS_SECTION_BEGIN)]
    for call in tool_calls:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        ids += [tokenizer.token_id(TOOL_CALL_BEGIN)] + tokenizer.encode(str(call.get("id", "")))
        ids += [tokenizer.token_id(TOOL_CALL_ARGUMENT_BEGIN)] + tokenizer.encode(args) + [tokenizer.token_id(TOOL_CALL_END)]
    return ids + [tokenizer.token_id(TOOL_CALLS_SECTION_END)]


def reconstruct_completion(
    tokenizer: KimiTokenizer,
    reasoning_ids: list[int],
    content_ids: list[int],
    finish_reason: str | None,
    tool_calls: list[dict[str, Any]] | None,
) -> list[int]:
    """Completion ids from the (already encoded) reasoning and content of one response."""
    think_end, im_end = tokenizer.token_id(THINK_END), tokenizer.token_id(IM_END)
    if finish_reason == "length" and not content_ids and not tool_calls:
        return list(reasoning_ids)  # cut inside the reasoning: no separator was generated
    ids = list(reasoning_ids) + [think_end] + list(content_ids)
    if tool_calls:
        ids += tool_calls_ids(tokenizer, tool_calls)
    if finish_reason != "length":
        ids.append(im_end)
    return ids


def build_token_ids(completions: pl.DataFrame, tokenizer: KimiTokenizer, *, mask_im_end: bool = True) -> pl.DataFrame:
    """One row per usable completion: input ids, loss mask, and the per-sample proof."""
    rows = completions.filter(pl.col("status").is_in(USABLE_STATUSES)).to_dicts()
    reasonings = tokenizer.encode_batch([r["reasoning"] or "" for r in rows])
    contents = tokenizer.encode_batch([r["content"] or "" for r in rows], allow_special=set(TOOL_CALL_MARKERS))
    think_end, im_end = tokenizer.token_id(THINK_END), tokenizer.token_id(IM_END)
    out = []
    for row, r_ids, c_ids in zip(rows, reasonings, contents):
        tool_calls = json.loads(row["tool_calls_json"]) if row["tool_calls_json"] else None
        rebuilt = reconstruct_completion(tokenizer, r_ids, c_ids, row["finish_reason"], tool_calls)
        backend_ids = row["completion_ids"]
        completion = list(backend_ids) if backend_ids is not None else rebuilt
        prompt = list(row["prompt_ids"])
        mask = [0] * len(prompt) + [1] * len(completion)
        if not mask_im_end and completion and completion[-1] == im_end:
            mask[-1] = 0
        billed = row["completion_tokens"]
        billed_prompt = row["prompt_tokens"]
        out.append(
            {
                "prompt_id": row["prompt_id"],
                "dataset": row["dataset"],
                "status": row["status"],
                "finish_reason": row["finish_reason"],
                "input_ids": prompt + completion,
                "loss_mask": mask,
                "prompt_len": len(prompt),
                "completion_len": len(completion),
                "ids_source": "backend" if backend_ids is not None else "text",
                "ids_match": (list(backend_ids) == rebuilt) if backend_ids is not None else None,
                "n_separators": completion.count(think_end),
                "has_end": bool(completion) and completion[-1] == im_end,
                "billed_completion_tokens": billed,
                "completion_len_diff": (len(completion) - billed) if billed is not None else None,
                "billed_prompt_tokens": billed_prompt,
                "prompt_len_diff": (len(prompt) - billed_prompt) if billed_prompt is not None else None,
                "text_roundtrip_ok": tokenizer.decode(r_ids) == (row["reasoning"] or "")
                and tokenizer.decode(c_ids) == (row["content"] or ""),
            }
        )
    return pl.DataFrame(
        out,
        schema={
            "prompt_id": pl.String,
            "dataset": pl.String,
            "status": pl.String,
            "finish_reason": pl.String,
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.Int8),
            "prompt_len": pl.Int64,
            "completion_len": pl.Int64,
            "ids_source": pl.String,
            "ids_match": pl.Boolean,
            "n_separators": pl.Int64,
            "has_end": pl.Boolean,
            "billed_completion_tokens": pl.Int64,
            "completion_len_diff": pl.Int64,
            "billed_prompt_tokens": pl.Int64,
            "prompt_len_diff": pl.Int64,
            "text_roundtrip_ok": pl.Boolean,
        },
    )


def token_ids_summary(df: pl.DataFrame) -> dict[str, Any]:
    """Aggregates for metadata: sizes, invariants and agreement with what was billed."""
    n = df.height
    if n == 0:
        return {"rows": 0}
    billed = df.filter(pl.col("billed_completion_tokens").is_not_null())
    total_billed = int(billed["billed_completion_tokens"].sum() or 0)
    total_diff = int(billed["completion_len_diff"].sum() or 0)
    with_backend = df.filter(pl.col("ids_source") == "backend")
    normal = df.filter(pl.col("finish_reason") == "stop")
    return {
        "rows": n,
        "tokens": int(df["prompt_len"].sum() + df["completion_len"].sum()),
        "completion_tokens": int(df["completion_len"].sum()),
        "billed_completion_tokens": total_billed,
        "billed_completion_diff_pct": round(100.0 * total_diff / total_billed, 4) if total_billed else None,
        "backend_ids_rows": with_backend.height,
        "backend_ids_match_pct": round(100.0 * with_backend["ids_match"].sum() / with_backend.height, 2) if with_backend.height else None,
        "normal_with_one_separator_pct": round(100.0 * (normal["n_separators"] == 1).sum() / normal.height, 2) if normal.height else None,
        "normal_ending_in_im_end_pct": round(100.0 * normal["has_end"].sum() / normal.height, 2) if normal.height else None,
        "text_roundtrip_ok_pct": round(100.0 * df["text_roundtrip_ok"].sum() / n, 2),
    }
