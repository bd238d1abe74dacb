"""One error tree: every error class of the project lives in eagle3_resources/errors.py under Eagle3Error, each
with its own `what_to_do`, and an asset's materialization turns one into a Dagster failure that says what to do."""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import dagster as dg

from eagle3_assets.common.registry import DatasetSpec
from eagle3_assets.definitions import resources
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources import errors
from eagle3_resources.errors import Eagle3Error, PromptFileError, TokenizerFolderError
from eagle3_resources.storage import DataStore
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3_assets", "eagle3_resources")
ERRORS_MODULE = REPO / "eagle3_resources" / "errors.py"
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def exception_classes() -> dict[str, list[tuple[Path, str]]]:
    """Every class of the two packages that derives from an exception, by name -> [(file, class name)].

    A class is an exception when a base is a builtin exception, or (repeated to a fixpoint) a class found so."""
    classes = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                    classes.append((path, node.name, bases))
    known = set(BUILTIN_EXCEPTIONS)
    while True:
        found = {name for _, name, bases in classes if any(b in known for b in bases)}
        if found <= known:
            break
        known |= found
    out: dict[str, list[tuple[Path, str]]] = {}
    for path, name, bases in classes:
        if any(b in known for b in bases):
            out.setdefault(name, []).append((path, name))
    return out


def test_every_error_class_is_defined_in_the_one_tree_under_its_base():
    found = exception_classes()
    elsewhere = [
        f"{path.relative_to(REPO)}: {name}"
        for name, places in found.items()
        for path, _ in places
        if path != ERRORS_MODULE and not name.startswith("_")
    ]
    assert not elsewhere, f"error classes outside eagle3_resources/errors.py: {elsewhere}"
    tree = {name for name, places in found.items() if any(path == ERRORS_MODULE for path, _ in places)}
    assert len(tree) >= 19  # the base, its five groups and the project's errors
    for name in tree:
        assert issubclass(getattr(errors, name), Eagle3Error), name
    # The module's docstring draws the tree: every class of it is in the picture.
    missing = [name for name in tree if f" {name} " not in errors.__doc__]
    assert not missing, f"not drawn in the docstring of eagle3_resources/errors.py: {missing}"


def test_private_control_flow_exceptions_never_leave_their_module():
    found = exception_classes()
    names = {}  # file -> every name its code uses (variables, attributes, imported names); not its strings
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names[path] = {
                getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None)
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, (ast.Name, ast.Attribute, ast.alias))
            }
    for name, places in found.items():
        if not name.startswith("_"):
            continue
        for home, _ in places:
            leaks = [str(path.relative_to(REPO)) for path, used in names.items() if path != home and name in used]
            assert not leaks, f"{name} (private to {home.relative_to(REPO)}) is used in {leaks}: move it to errors.py"


def test_each_error_says_what_to_do_in_its_own_words():
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, Eagle3Error) and c.__module__ == errors.__name__
    ]
    for cls in classes:
        text = cls.__dict__.get("what_to_do")
        assert isinstance(text, str) and text.strip(), f"{cls.__name__} has no what_to_do of its own"
    texts = [c.what_to_do for c in classes]
    assert len(set(texts)) == len(texts), "two errors share one what_to_do"


def materialize_raw_prompts(tmp_path, monkeypatch, prompt_file: Path, tokenizer: TokenizerResource | None = None):
    spec = DatasetSpec(name="A1", prompt_file=prompt_file, format="messages", kind="chat")
    monkeypatch.setattr("eagle3_assets.stages.raw_prompts.asset.DATASETS", {"A1": spec})
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts],
            partition_key="A1",
            instance=instance,
            raise_on_error=False,
            resources={
                **resources(),
                "store": DataStore(root=str(tmp_path / "data")),
                **({"tokenizer": tokenizer} if tokenizer else {}),
            },
        )
    assert not result.success
    return result.failure_data_for_node("raw_prompts")


def test_a_bad_prompt_file_fails_raw_prompts_with_the_line_and_what_to_do(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
        '{"id": "b", "messages": [{"role": "robot", "content": "x"}]}\n'
    )
    failure = materialize_raw_prompts(tmp_path, monkeypatch, bad)
    description = failure.user_failure_data.description
    assert description.startswith("Bad prompt input (sample prompts); nothing downstream ran.\n\n1 problem(s) in ")
    assert f"{bad}:2: b: message 1: unknown role 'robot'" in description
    assert description.endswith(f"\n\nWhat to do: {PromptFileError.what_to_do}")
    assert failure.user_failure_data.metadata["error"].value == "PromptFileError"
    assert failure.error.cause.cls_name == "PromptFileError"  # the error stays the failure's cause in the event log


def test_an_error_escaping_an_asset_becomes_a_failure_that_says_what_to_do(tmp_path, monkeypatch):
    # A tokenizer folder with no tokenizer in it: TokenizerFolderError is raised inside raw_prompts and not caught
    # there; the asset's @failure_for_operator turns it into the failure.
    empty = tmp_path / "not-a-tokenizer"
    empty.mkdir()
    tokenizer = TokenizerResource(path=str(empty), standin_dir=str(tmp_path / "standin"))
    failure = materialize_raw_prompts(tmp_path, monkeypatch, REPO / "data" / "prompts" / "A1.jsonl", tokenizer)
    assert failure.user_failure_data is not None, failure.error.to_string()
    description = failure.user_failure_data.description
    assert f"{empty}: no " in description and "is this a Kimi tokenizer folder?" in description
    assert description.endswith(f"\n\nWhat to do: {TokenizerFolderError.what_to_do}")
    assert failure.user_failure_data.metadata["what_to_do"].value == TokenizerFolderError.what_to_do
