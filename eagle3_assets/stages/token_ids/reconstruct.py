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
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa

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
        ids += (
            [tokenizer.token_id(TOOL_CALL_ARGUMENT_BEGIN)]
            + tokenizer.encode(args)
            + [tokenizer.token_id(TOOL_CALL_END)]
        )
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


TOKEN_IDS_SCHEMA = {
    "prompt_id": pl.String,
    "dataset": pl.String,
    "status": pl.String,
    "finish_reason": pl.String,
    "prompt_len": pl.Int64,
    "completion_len": pl.Int64,
    "ids_source": pl.String,
    "ids_match": pl.Boolean,
    "n_separators": pl.Int64,
    "has_end": pl.Boolean,
    "n_leaked_specials": pl.Int64,
    "tool_call_think_end": pl.String,
    "billed_completion_tokens": pl.Int64,
    "completion_len_diff": pl.Int64,
    "billed_prompt_tokens": pl.Int64,
    "prompt_len_diff": pl.Int64,
    "text_roundtrip_ok": pl.Boolean,
    "tools_in_request": pl.String,
}


def _list_column(flat: array[int], lengths: list[int]) -> pl.Series:
    """An Int32 list column from one flat buffer and row lengths (no per-row Series)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.frombuffer(flat, dtype=np.int32) if len(flat) else np.zeros(0, dtype=np.int32)
    # from_arrow gives a Series for an Arrow array (a DataFrame for a table)
    return cast(pl.Series, pl.from_arrow(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))))


SCALAR_INPUTS = [
    "prompt_id",
    "dataset",
    "status",
    "finish_reason",
    "reasoning",
    "content",
    "tool_calls_json",
    "completion_tokens",
    "prompt_tokens",
    "tools_in_request",
]


def build_token_ids(
    completions: pl.DataFrame,
    tokenizer: KimiTokenizer,
    *,
    mask_im_end: bool = True,
    billed_includes_im_end: bool = True,
) -> pl.DataFrame:
    """One row per usable completion: input ids, loss mask, and the per-sample proof.

    `billed_includes_im_end`: whether the provider's `completion_tokens` counts the final
    `<|im_end|>` (not documented; measure it on a pilot: the aggregate difference is 0 with the
    right setting and about -1 per sample with the wrong one).
    Built for speed: the texts are encoded in parallel (tiktoken's threads), completion ids go
    into one flat buffer, and prompt ids never leave Arrow.
    """
    usable = completions.filter(pl.col("status").is_in(USABLE_STATUSES))
    if "tools_in_request" not in usable.columns:
        usable = usable.with_columns(tools_in_request=pl.lit(None, pl.String))
    end_in_bill = 0 if billed_includes_im_end else 1
    cols, flat = _per_sample_columns(usable, tokenizer, end_in_bill)
    computed = {"prompt_len", "n_separators", "has_end", "n_leaked_specials", "completion_len_diff", "prompt_len_diff"}
    df = pl.DataFrame(
        {k: v for k, v in cols.items() if k not in computed},
        schema={k: v for k, v in TOKEN_IDS_SCHEMA.items() if k not in computed},
    )
    df = df.with_columns(
        prompt_ids=usable["prompt_ids"].cast(pl.List(pl.Int32)), completion=_list_column(flat, cols["completion_len"])
    )
    df = _with_invariants(df, tokenizer, end_in_bill)
    return _with_training_columns(df, mask_im_end)


def _per_sample_columns(
    usable: pl.DataFrame, tokenizer: KimiTokenizer, end_in_bill: int
) -> tuple[dict[str, list[Any]], array[int]]:
    """The columns computed row by row (the completion ids, their source and the proof from text), and every
    completion's ids in one flat buffer."""
    rows = usable.select(SCALAR_INPUTS).rows()
    backend_col = usable["completion_ids"]
    backend = backend_col.to_list() if backend_col.null_count() < len(backend_col) else [None] * len(rows)
    think_end, im_end = tokenizer.token_id(THINK_END), tokenizer.token_id(IM_END)
    flat = array("i")
    cols: dict[str, list[Any]] = {name: [] for name in TOKEN_IDS_SCHEMA}
    encoded = _encoded_in_background(tokenizer, rows)
    for row, (r_ids, c_ids), backend_ids in zip(rows, encoded, backend, strict=True):  # all three: one per row
        pid, dataset, status, finish, reasoning, content, tool_json, billed, billed_prompt, tools_in_request = row
        tool_calls = json.loads(tool_json) if tool_json else None
        rebuilt, think_end_kind = _rebuilt_completion(tokenizer, r_ids, c_ids, finish, tool_calls, billed, end_in_bill)
        completion = backend_ids if backend_ids is not None else rebuilt
        flat.extend(completion)
        for name, value in (
            ("prompt_id", pid),
            ("dataset", dataset),
            ("status", status),
            ("finish_reason", finish),
            ("completion_len", len(completion)),
            ("ids_source", "backend" if backend_ids is not None else "text"),
            ("ids_match", (backend_ids == rebuilt) if backend_ids is not None else None),
            ("tool_call_think_end", think_end_kind),
            ("billed_completion_tokens", billed),
            ("billed_prompt_tokens", billed_prompt),
            # decode(ids) == the returned text. Ids encoded from that text decode back to it by
            # construction (BPE is lossless), so only the backend's own ids are worth decoding.
            (
                "text_roundtrip_ok",
                None
                if backend_ids is None
                else tokenizer.decode(backend_ids) == _as_generated(reasoning, content, backend_ids, think_end, im_end),
            ),
            ("tools_in_request", tools_in_request),
        ):
            cols[name].append(value)
    return cols, flat


def _rebuilt_completion(
    tokenizer: KimiTokenizer,
    r_ids: list[int],
    c_ids: list[int],
    finish: str | None,
    tool_calls: list[dict[str, Any]] | None,
    billed: int | None,
    end_in_bill: int,
) -> tuple[list[int], str | None]:
    """The completion ids from text, and how a tool-call turn ended its reasoning ("explicit", "implicit",
    "unknown"; None for other turns). Where the text leaves a choice the bill settles it."""
    rebuilt = reconstruct_completion(tokenizer, r_ids, c_ids, finish, tool_calls)
    think_end_kind = None
    if finish == "length" and not c_ids and not tool_calls and billed is not None and len(rebuilt) + 1 == billed:
        rebuilt = rebuilt + [tokenizer.token_id(THINK_END)]  # cut right after </think>: the bill counts the separator
    if tool_calls and not c_ids and billed is not None:
        # A tool-call turn may end the reasoning implicitly (no </think>): the bill tells which.
        implicit = rebuilt[: len(r_ids)] + rebuilt[len(r_ids) + 1 :]
        think_end_kind = "explicit" if len(rebuilt) - end_in_bill == billed else "unknown"
        if len(implicit) - end_in_bill == billed:
            rebuilt, think_end_kind = implicit, "implicit"
    return rebuilt, think_end_kind


def _with_invariants(df: pl.DataFrame, tokenizer: KimiTokenizer, end_in_bill: int) -> pl.DataFrame:
    """The per-sample invariants, counted in Rust over the whole column."""
    think_end, im_end = tokenizer.token_id(THINK_END), tokenizer.token_id(IM_END)
    allowed = {think_end, im_end} | {tokenizer.token_id(m) for m in TOOL_CALL_MARKERS}
    leak_ids = sorted(tokenizer.special_ids - allowed)
    completion = pl.col("completion")
    df = df.with_columns(
        prompt_len=pl.col("prompt_ids").list.len().cast(pl.Int64),
        n_separators=completion.list.count_matches(think_end).cast(pl.Int64),
        has_end=(completion.list.last() == im_end).fill_null(False),
        n_leaked_specials=(
            completion.list.eval(pl.element().is_in(leak_ids)).list.sum()
            + completion.list.count_matches(im_end)
            - (completion.list.last() == im_end).fill_null(False).cast(pl.UInt32)
        ).cast(pl.Int64),
    ).with_columns(
        completion_len_diff=pl.col("completion_len")
        - end_in_bill * pl.col("has_end").cast(pl.Int64)
        - pl.col("billed_completion_tokens"),
    )
    return df.with_columns(prompt_len=pl.col("prompt_ids").list.len().cast(pl.Int64))


def _with_training_columns(df: pl.DataFrame, mask_im_end: bool) -> pl.DataFrame:
    """A training sample: `input_ids` (prompt, then completion) and its `loss_mask` over the completion."""
    unmasked_end = (pl.col("has_end") & pl.lit(not mask_im_end)).cast(pl.Int64)
    zero, one = pl.lit(0, pl.Int8), pl.lit(1, pl.Int8)
    df = df.with_columns(
        input_ids=pl.concat_list("prompt_ids", "completion"),
        loss_mask=pl.concat_list(
            zero.repeat_by(pl.col("prompt_len")),
            one.repeat_by(pl.col("completion_len") - unmasked_end),
            zero.repeat_by(unmasked_end),
        ),
        prompt_len_diff=pl.col("prompt_len") - pl.col("billed_prompt_tokens"),
    )
    return df.select(
        "prompt_id", "dataset", "status", "finish_reason", "input_ids", "loss_mask", *list(TOKEN_IDS_SCHEMA)[4:]
    )


def _as_generated(reasoning: str | None, content: str | None, ids: list[int], think_end: int, im_end: int) -> str:
    """The text a model wrote, special tokens spelled out, from what an API returns."""
    text = (reasoning or "") + ("</think>" + (content or "") if think_end in ids else "")
    return text + ("<|im_end|>" if ids and ids[-1] == im_end else "")


def _encoded_in_background(
    tokenizer: KimiTokenizer, rows: list[tuple[Any, ...]], block: int = 128
) -> Iterator[tuple[list[int], list[int]]]:
    """(reasoning ids, content ids) per row, encoded one block ahead in a worker thread.

    tiktoken encodes with the GIL released, so while block k+1 is being encoded the caller's
    Python work on block k runs beside it: the reconstruction costs little more than the encode.
    """

    def encode(lo: int) -> tuple[list[list[int]], list[list[int]]]:
        chunk = rows[lo : lo + block]
        return encode_completion_texts(tokenizer, [r[4] or "" for r in chunk], [r[5] or "" for r in chunk])

    with ThreadPoolExecutor(1) as pool:
        if not rows:
            return
        pending = pool.submit(encode, 0)
        for lo in range(0, len(rows), block):
            r_ids, c_ids = pending.result()
            if lo + block < len(rows):
                pending = pool.submit(encode, lo + block)
            yield from zip(r_ids, c_ids, strict=True)  # one reasoning and one content per row


def encode_completion_texts(
    tokenizer: KimiTokenizer, reasonings: list[str], contents: list[str]
) -> tuple[list[list[int]], list[list[int]]]:
    """(reasoning ids, content ids): free text without special tokens, except the tool-call
    markers in content. One batch over every text that holds no marker string (the same ids
    either way); the few contents with markers get their own pass."""
    with_markers = [i for i, c in enumerate(contents) if "<|tool_call" in c]
    marked = set(with_markers)
    plain = tokenizer.encode_batch(reasonings + [c for i, c in enumerate(contents) if i not in marked])
    r_ids, plain_contents = plain[: len(reasonings)], iter(plain[len(reasonings) :])
    special = tokenizer.encode_batch([contents[i] for i in with_markers], allow_special=set(TOOL_CALL_MARKERS))
    by_index = dict(zip(with_markers, special, strict=True))  # one encoding per text
    c_ids = [by_index[i] if i in marked else next(plain_contents) for i in range(len(contents))]
    return r_ids, c_ids


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
        "tokens": int(df["prompt_len"].sum()) + int(df["completion_len"].sum()),
        "completion_tokens": int(df["completion_len"].sum()),
        "billed_completion_tokens": total_billed,
        "billed_completion_diff_pct": round(100.0 * total_diff / total_billed, 4) if total_billed else None,
        "backend_ids_rows": with_backend.height,
        "backend_ids_match_pct": round(100.0 * int(with_backend["ids_match"].sum()) / with_backend.height, 2)
        if with_backend.height
        else None,
        "normal_with_one_separator_pct": round(100.0 * int((normal["n_separators"] == 1).sum()) / normal.height, 2)
        if normal.height
        else None,
        "normal_ending_in_im_end_pct": round(100.0 * int(normal["has_end"].sum()) / normal.height, 2)
        if normal.height
        else None,
        "backend_ids_decode_to_text_pct": round(
            100.0 * int(with_backend["text_roundtrip_ok"].sum()) / with_backend.height, 2
        )
        if with_backend.height
        else None,
    }
