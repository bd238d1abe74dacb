"""Importing the real prompt sets from fixtures in each source's own schema (tests/data/sources).

Expected prompts are written out whole, by hand, from the fixture rows: the oracle is the source
schema as its dataset card describes it, not the converter's code.
"""

import json
import random
from pathlib import Path

import pytest
from support import build_source_tree

from eagle3_assets.common.registry import DatasetSpec, ImportSpec, load_registry
from eagle3_assets.stages.raw_prompts.importers.build import build_prompt_sets
from eagle3_assets.stages.raw_prompts.importers.importer import PromptLength

REPO = Path(__file__).resolve().parents[1]
REGISTRY = load_registry(REPO / "data" / "datasets.yaml")


# An independent stand-in for the target's rendering and token count: contents, whitespace words.
words = PromptLength(
    render=lambda messages, tools: "\n".join(m.get("content") or "" for m in messages),
    count=lambda text: len(text.split()),
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return build_source_tree(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def imported(sources, tmp_path_factory):
    rejects = tmp_path_factory.mktemp("rejects")
    sets = build_prompt_sets(
        list(REGISTRY),
        REGISTRY,
        mode="real",
        length=words,
        sources_dir=sources,
        rejects_path=lambda name: rejects / f"{name}.rejects.jsonl",
        log=lambda msg: None,
    )
    return sets, rejects


def by_row(result):
    return {p.source_row: {"messages": p.messages, "tools": p.tools} for p in result.prompts}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
STOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "get_stock_price",
        "description": "Get the current stock price",
        "parameters": {
            "type": "object",
            "properties": {"symbol": {"type": "string", "description": "The stock symbol"}},
            "required": ["symbol"],
        },
    },
}
GLAIVE_SYSTEM = {
    "role": "system",
    "content": "You are a helpful assistant with access to the following functions. Use them if required",
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the internal documentation",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

EXPECTED = {
    # glaive-function-calling-v2 (`system` + `chat`): single exchanges go to B1 (max_turns 1) ...
    "B1": {
        "glaive-function-calling-v2.json:1": {
            "tools": [WEATHER_TOOL],
            "messages": [
                GLAIVE_SYSTEM,
                {"role": "user", "content": "What's the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "functions.get_weather:0",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "functions.get_weather:0",
                    "name": "get_weather",
                    "content": '{"temperature": 18, "sky": "cloudy"}',
                },
            ],
        },
        "glaive-function-calling-v2.json:2": {
            "tools": None,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
                {"role": "user", "content": "Can you order a pizza for me?"},
            ],
        },
        # the system prompt inside `chat`
        "glaive-function-calling-v2.json:4": {
            "tools": None,
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name a prime number above 100."},
            ],
        },
        # a tool result that is not JSON stays text
        "glaive-function-calling-v2.json:5": {
            "tools": [STOCK_TOOL],
            "messages": [
                GLAIVE_SYSTEM,
                {"role": "user", "content": "What is MSFT at?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "functions.get_stock_price:0",
                            "type": "function",
                            "function": {"name": "get_stock_price", "arguments": '{"symbol": "MSFT"}'},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "functions.get_stock_price:0",
                    "name": "get_stock_price",
                    "content": "Error 503: upstream quote service unavailable",
                },
            ],
        },
    },
    # ... and multi-turn ones to B3 (min_turns 2)
    "B3": {
        "glaive-function-calling-v2.json:3": {
            "tools": [WEATHER_TOOL, STOCK_TOOL],
            "messages": [
                GLAIVE_SYSTEM,
                {"role": "user", "content": "I need some information."},
                {"role": "assistant", "content": "Sure, what would you like to know?"},
                {"role": "user", "content": "The price of Apple stock."},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "functions.get_stock_price:0",
                            "type": "function",
                            "function": {"name": "get_stock_price", "arguments": '{"symbol": "AAPL"}'},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "functions.get_stock_price:0",
                    "name": "get_stock_price",
                    "content": '{"price": 189.5}',
                },
                {"role": "assistant", "content": "Apple trades at $189.50."},
                {"role": "user", "content": "And the weather in Tokyo?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "functions.get_weather:1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "functions.get_weather:1",
                    "name": "get_weather",
                    "content": '{"temperature": 22, "sky": "clear"}',
                },
            ],
        },
    },
    # OpenCodeInstruct (`id`, `input`, `output`, ...): `input` is the user turn; the very long row is over
    # max_prompt_tokens
    "B2": {
        "data/train-00000-of-00001.parquet:1": {
            "tools": None,
            "messages": [
                {
                    "role": "user",
                    "content": "Implement a function `is_palindrome(s: str) -> bool` that ignores case "
                    "and non-alphanumeric characters.",
                }
            ],
        },
        "data/train-00000-of-00001.parquet:2": {
            "tools": None,
            "messages": [
                {
                    "role": "user",
                    "content": "You are given a list of integers `nums`. Return the length "
                    "of the longest strictly increasing subsequence.\n\n"
                    "**Sample Input:**\n```\n[10, 9, 2, 5, 3, 7, 101, 18]\n```\n**Sample Output:**\n```\n4\n```",
                }
            ],
        },
    },
    # Mixture-of-Thoughts (`messages`, `num_tokens`, `source`): the answer with its <think> is dropped, a system
    # prompt kept
    "B4": {
        "all/train-00000-of-00001.parquet:1": {
            "tools": None,
            "messages": [
                {"role": "user", "content": "Find all real x with x^2 - 5x + 6 = 0. Put the final answer in \\boxed{}."}
            ],
        },
        "all/train-00000-of-00001.parquet:2": {
            "tools": None,
            "messages": [
                {"role": "system", "content": "You are an expert competitive programmer."},
                {
                    "role": "user",
                    "content": "Given n, print the n-th Fibonacci number modulo 1e9+7. n can be up to 1e18.",
                },
            ],
        },
        "all/train-00000-of-00001.parquet:3": {
            "tools": None,
            "messages": [{"role": "user", "content": "Why does ice float on water?"}],
        },
    },
    # OpenThoughts-114k (`system`, `conversations` of from/value): its system prompt dropped (system: drop)
    "B5": {
        "data/train-00000-of-00001.parquet:1": {
            "tools": None,
            "messages": [
                {
                    "role": "user",
                    "content": "Return your final response within \\boxed{}. "
                    "What is the sum of the first 100 positive integers?",
                }
            ],
        },
        "data/train-00000-of-00001.parquet:2": {
            "tools": None,
            "messages": [
                {
                    "role": "user",
                    "content": "Generate an executable Python function generated from the given prompt. "
                    "Read N and print N factorial.",
                }
            ],
        },
    },
    # ultrachat_200k (`prompt`, `prompt_id`, `messages`): the history kept, the last answer dropped; French
    # filtered (languages: [en])
    "B6": {
        "data/train_sft-00000-of-00001.parquet:1": {
            "tools": None,
            "messages": [
                {"role": "user", "content": "How did the printing press change Europe?"},
                {"role": "assistant", "content": "It spread literacy, ..."},
                {"role": "user", "content": "Which cities printed the most books by 1500?"},
            ],
        },
        "data/train_sft-00000-of-00001.parquet:4": {
            "tools": None,
            "messages": [{"role": "user", "content": "What are three tips for a job interview?"}],
        },
    },
    # OpenAI chat format (in-house): content parts joined, raw U+2028 / U+0085 kept inside the text
    "A1": {
        "in-house/A1/prompts.jsonl:1": {
            "tools": None,
            "messages": [{"role": "user", "content": "What is a good name for a grey cat?"}],
        },
        "in-house/A1/prompts.jsonl:2": {
            "tools": None,
            "messages": [
                {"role": "system", "content": "你是一个乐于助人的助手。"},
                {"role": "user", "content": "请用三句话介绍长城。"},
            ],
        },
        "in-house/A1/prompts.jsonl:3": {
            "tools": None,
            "messages": [
                {
                    "role": "user",
                    "content": "Summarise this:\u2028line two after a raw LINE SEPARATOR, and a raw NEL\u0085here.",
                }
            ],
        },
    },
    # tools and a tool result kept; arguments given as an object become JSON text
    "A2": {
        "in-house/A2/prompts.jsonl:1": {
            "tools": [SEARCH_TOOL],
            "messages": [
                {"role": "user", "content": "How do I rotate the API key?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "search_docs", "arguments": '{"query": "rotate API key"}'},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "name": "search_docs",
                    "content": "Rotate keys under Settings > Security. (plain text, not JSON)",
                },
            ],
        },
    },
}


@pytest.mark.parametrize("dataset", sorted(EXPECTED))
def test_each_source_schema_imports_to_the_expected_prompts(imported, dataset):
    sets, _ = imported
    assert by_row(sets[dataset]) == EXPECTED[dataset]


REJECTED = {
    "B1": {
        "glaive-function-calling-v2.json:6": "message 2: empty user content",
        "glaive-function-calling-v2.json:7": "arguments of 'get_weather' are not valid JSON",
        "glaive-function-calling-v2.json:9": "calls 'book_flight', which is not declared in tools",
    },
    "B2": {"data/train-00000-of-00001.parquet:3": 'empty or missing "input"'},
    "B4": {"all/train-00000-of-00001.parquet:4": "no user turn before the final answer"},
    "B5": {
        "data/train-00000-of-00001.parquet:3": "speaker 'function_call'",
        "data/train-00000-of-00001.parquet:4": "empty user content",
    },
    "B6": {"data/train_sft-00000-of-00001.parquet:2": "assistant message with neither content nor tool_calls"},
    "A1": {"in-house/A1/prompts.jsonl:4": "content part of type 'image_url'"},
    "A2": {"in-house/A2/prompts.jsonl:2": "tool_call_id 'call_7' does not match an earlier tool call"},
}


@pytest.mark.parametrize("dataset", sorted(REJECTED))
def test_bad_rows_are_skipped_into_the_rejects_file_with_reason_and_source_row(imported, dataset):
    sets, rejects = imported
    lines = [json.loads(line) for line in (rejects / f"{dataset}.rejects.jsonl").read_text().splitlines()]
    assert {r["source_row"] for r in lines} == set(REJECTED[dataset])
    for r in lines:
        assert REJECTED[dataset][r["source_row"]] in r["reason"]
        assert r["row"]  # the source row itself, to fix or report upstream
    report = sets[dataset].report
    assert (
        report.rejected == len(REJECTED[dataset])
        and report.rows
        == report.rejected
        + report.duplicates
        + sum(report.duplicates_of.values())
        + sum(report.filtered.values())
        + report.selected
    )


def test_duplicates_within_and_across_datasets_are_kept_once_and_reported(imported):
    sets, _ = imported
    # glaive row 8 is row 2 up to case and spacing; B3 reads the same file as B1 and finds B1's four prompts there
    assert sets["B1"].report.duplicates == 1
    assert dict(sets["B3"].report.duplicates_of) == {"B1": 4}
    assert sets["B2"].report.duplicates == 1  # the same instruction under two ids
    keys = [p.key for r in sets.values() for p in r.prompts]
    assert len(keys) == len(set(keys))
    assert dict(sets["B1"].report.filtered) == {"max_turns": 1}
    assert dict(sets["B2"].report.filtered) == {"max_prompt_tokens": 1}
    assert dict(sets["B6"].report.filtered) == {"language": 1}


def instruction_registry(tmp_path, files: dict[str, str], *, cap=None, seed=0) -> dict[str, DatasetSpec]:
    reg = {}
    for name, pattern in files.items():
        reg[name] = DatasetSpec(
            name=name,
            prompt_file=tmp_path / "unused.jsonl",
            format="messages",
            kind="code",
            sample_cap=cap,
            real=ImportSpec(schema="instruction", files=pattern, seed=seed),
        )
    return reg


def write_instructions(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"r{i}", "input": t}) + "\n" for i, t in enumerate(texts)))


def sample_ids(tmp_path, reg, names, **kw):
    sets = build_prompt_sets(
        names, reg, mode="real", length=words, sources_dir=tmp_path / "src", log=lambda m: None, **kw
    )
    return {n: [p.prompt_id for p in r.prompts] for n, r in sets.items()}, sets


def test_sampling_is_reproducible_whatever_the_row_order(tmp_path):
    texts = [f"Task number {i}: write a function that returns {i} squared." for i in range(400)]
    write_instructions(tmp_path / "src" / "a" / "part.jsonl", texts)
    shuffled = texts[:]
    random.Random(7).shuffle(shuffled)
    write_instructions(tmp_path / "src" / "b" / "part.jsonl", shuffled)
    reg = instruction_registry(tmp_path, {"X1": "a/*.jsonl"}, cap=50, seed=3)
    first, _ = sample_ids(tmp_path, reg, ["X1"])
    again, _ = sample_ids(tmp_path, reg, ["X1"])
    reordered, _ = sample_ids(tmp_path, instruction_registry(tmp_path, {"X1": "b/*.jsonl"}, cap=50, seed=3), ["X1"])
    other_seed, _ = sample_ids(tmp_path, instruction_registry(tmp_path, {"X1": "a/*.jsonl"}, cap=50, seed=4), ["X1"])
    bigger, _ = sample_ids(tmp_path, instruction_registry(tmp_path, {"X1": "a/*.jsonl"}, cap=80, seed=3), ["X1"])
    assert len(first["X1"]) == 50 and first == again == reordered
    assert set(other_seed["X1"]) != set(first["X1"])
    assert set(first["X1"]) < set(bigger["X1"])  # a larger cap keeps every prompt of a smaller one


def test_a_prompt_two_datasets_share_is_kept_once_by_the_earlier_one(tmp_path):
    shared = [f"Shared question {i}: explain recursion with an example." for i in range(30)]
    write_instructions(tmp_path / "src" / "one" / "p.jsonl", shared + [f"Only in one {i}" for i in range(10)])
    write_instructions(
        tmp_path / "src" / "two" / "p.jsonl", [s.upper() for s in shared] + [f"Only in two {i}" for i in range(10)]
    )
    reg = instruction_registry(tmp_path, {"X1": "one/*.jsonl", "X2": "two/*.jsonl"})
    together, sets = sample_ids(tmp_path, reg, ["X1", "X2"])
    assert len(together["X1"]) == 40 and len(together["X2"]) == 10
    assert dict(sets["X2"].report.duplicates_of) == {"X1": 30}
    # X2 built alone against X1's materialized keys selects the same prompts; never built: reported
    keys = [p.key for p in sets["X1"].prompts]
    alone, _ = sample_ids(tmp_path, reg, ["X2"], built_keys=lambda name: keys if name == "X1" else None)
    assert alone["X2"] == together["X2"]
    _, unchecked = sample_ids(tmp_path, reg, ["X2"])
    assert unchecked["X2"].not_checked_against == ["X1"] and len(unchecked["X2"].prompts) == 40


def test_the_registry_import_blocks_are_validated(tmp_path):
    from eagle3_resources.errors import RegistryError

    reg = tmp_path / "r.yaml"
    base = "datasets:\n  X1:\n    prompt_file: x.jsonl\n    format: messages\n    kind: chat\n    import:\n"
    for block, fragment in [
        ("      schema: csv\n      files: a\n", "schema 'csv'"),
        ("      schema: messages\n", "missing field 'files'"),
        ("      schema: messages\n      files: a\n      languages: english\n", "languages must be a list"),
        ("      schema: messages\n      files: a\n      min_turns: 3\n      max_turns: 2\n", "min_turns 3 is above"),
        ("      schema: messages\n      files: a\n      max_reject_rate: 5\n", "max_reject_rate"),
        ("      schema: messages\n      files: a\n      colour: red\n", "unknown field(s) ['colour']"),
    ]:
        reg.write_text(base + block)
        with pytest.raises(
            RegistryError,
            match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
        ):
            load_registry(reg)


def test_real_mode_names_datasets_without_a_source(tmp_path):
    from eagle3_resources.errors import RegistryError

    reg = {"X1": DatasetSpec(name="X1", prompt_file=tmp_path / "x.jsonl", format="messages", kind="chat")}
    with pytest.raises(RegistryError, match="no `import:` source in the registry for X1"):
        build_prompt_sets(["X1"], reg, mode="real", length=words)


def test_an_in_house_set_without_a_sources_folder_says_what_to_set(tmp_path):
    from eagle3_resources.errors import SourceError

    with pytest.raises(
        SourceError, match=r"A1 is an in-house set \(no hub id\): set EAGLE3_SOURCES_DIR .* in-house/A1/\*\.jsonl"
    ):
        build_prompt_sets(["A1"], REGISTRY, mode="real", length=words, log=lambda m: None)


def test_a_parquet_source_without_the_needed_column_fails_naming_the_file_and_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_resources.errors import SourceError

    (tmp_path / "src" / "x").mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist([{"instruction": "a", "response": "b"}]), tmp_path / "src" / "x" / "part-0.parquet"
    )
    reg = instruction_registry(tmp_path, {"X1": "x/*.parquet"})
    with pytest.raises(
        SourceError,
        match=r"X1: x/part-0.parquet: no column\(s\) \['input'\]; the file has \['instruction', 'response'\]",
    ):
        build_prompt_sets(["X1"], reg, mode="real", length=words, sources_dir=tmp_path / "src", log=lambda m: None)


def test_prompt_length_bounds_keep_exactly_the_prompts_inside_them(tmp_path):
    texts = [" ".join(["word"] * n) + f" {n}" for n in range(1, 40)]  # 2..40 words, 4..200 bytes
    write_instructions(tmp_path / "src" / "l" / "p.jsonl", texts)
    for low, high in ((None, 10), (8, None), (5, 12), (30, 35)):
        reg = {
            "X1": DatasetSpec(
                name="X1",
                prompt_file=tmp_path / "x.jsonl",
                format="messages",
                kind="code",
                real=ImportSpec(schema="instruction", files="l/*.jsonl", min_prompt_tokens=low, max_prompt_tokens=high),
            )
        }
        _, sets = sample_ids(tmp_path, reg, ["X1"])
        kept = sorted(len(p.messages[0]["content"].split()) for p in sets["X1"].prompts)
        want = [n for n in (len(t.split()) for t in texts) if (low is None or n >= low) and (high is None or n <= high)]
        assert kept == want, (low, high)
        report = sets["X1"].report
        assert report.filtered["min_prompt_tokens"] + report.filtered["max_prompt_tokens"] == len(texts) - len(want)
