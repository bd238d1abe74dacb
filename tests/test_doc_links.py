"""The README and the docs link only to what exists: files, and headings by GitHub's anchors.

For README.md, docs/*.md and deploy/README.md, every relative markdown link `[text](path)`, `[text](path#anchor)` or
`[text](#anchor)` (images and reference definitions too) must name a file or folder of this repository, and every
anchor must be a heading of the target markdown file under GitHub's slug rules: the heading's text, lowercased,
punctuation dropped but for `-` and `_`, spaces turned into `-`, a repeated slug numbered `-1`, `-2`. External links
(`http(s)://`, `mailto:`) are not fetched. Fenced code blocks and inline code are not markdown, so neither their `#`
lines nor their brackets count.

Also: the README stays a five-minute read (at most 250 lines, its first code block the two commands) and its
documentation map links every page under docs/.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
CHECKED = [REPO / "README.md", *DOCS, REPO / "deploy" / "README.md"]
README_MAX_LINES = 250
TWO_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install --no-compile -e . && .venv/bin/eagle3 run\n"
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest\n"
)

FENCE = re.compile(r"^ {0,3}(?:\s*)(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
CODE_LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before numbering repeats)."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of one markdown file, repeated slugs numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in one markdown file's prose, inline code blanked out."""
    out = []
    for number, line in prose_lines(path.read_text()):
        line = CODE_SPAN.sub(lambda m: m.group(1) + "x" * len(m.group(2)) + m.group(1), line)
        out += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        m = REFERENCE_DEFINITION.match(line)
        if m:
            out.append((number, m.group(1)))
    return out


def broken_links(path: Path, repo: Path = REPO) -> list[str]:
    """`file:line target: why` for every relative link of one file that does not resolve."""
    problems = []
    for number, target in links(path):
        if SCHEME.match(target):
            continue  # http(s), mailto: not fetched
        where = f"{path.relative_to(repo)}:{number} {target}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not resolved.is_relative_to(repo):
            problems.append(f"{where}: outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where}: no such file")
            continue
        if not anchor:
            continue
        if resolved.suffix == ".md":
            if unquote(anchor) not in anchors(resolved):
                problems.append(f"{where}: no heading with that anchor in {resolved.relative_to(repo)}")
        elif not (resolved.is_file() and CODE_LINE_ANCHOR.match(anchor)):
            problems.append(f"{where}: an anchor into a file that has no headings")
    return problems


def test_the_checked_files_are_there():
    assert len(DOCS) >= 8, DOCS
    assert all(f.is_file() for f in CHECKED), CHECKED


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert links(path) or path.name != "README.md" or path.parent != REPO, "no links found in the README"
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_is_short_and_maps_every_doc():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md is {len(text.splitlines())} lines"
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first_block and first_block.group(1) == TWO_COMMANDS, "the README's first code block is the two commands"
    linked = {(REPO / unquote(t.partition("#")[0])).resolve() for _, t in links(REPO / "README.md")}
    unmapped = [d.relative_to(REPO).as_posix() for d in DOCS if d.resolve() not in linked]
    assert not unmapped, f"docs the README's documentation map does not link: {unmapped}"


def test_github_slugs():
    assert slug("GPU host: from a fresh host to a measured drafter") == (
        "gpu-host-from-a-fresh-host-to-a-measured-drafter"
    )
    assert slug("2. Check the host: `eagle3 gpu-check`") == "2-check-the-host-eagle3-gpu-check"
    assert slug("The operator's view") == "the-operators-view"
    assert slug("The real prompt sets: A1..B8 from their public sources") == (
        "the-real-prompt-sets-a1b8-from-their-public-sources"
    )
    assert slug("snake_case and -dashes-") == "snake_case-and--dashes-"


def test_the_checker_finds_what_is_broken(tmp_path):
    """The checker itself, on a small tree: each kind of broken link is reported, nothing else is."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Same\n\n## Same\n\n```bash\n# not a heading [x](missing.md)\n```\n"
        "[ok](#same-1) [ok](b.md#b-section) ![ok](b.md) [ok](https://example.com/nowhere) `[x](code.md)`\n"
        "[bad file](c.md) [bad anchor](#same-2) [bad cross anchor](b.md#nope) [fenced](#not-a-heading)\n"
        "[ref]: b.md#b-section\n[badref]: ../../outside.md\n"
    )
    (tmp_path / "docs" / "b.md").write_text("# B section\n")
    problems = broken_links(tmp_path / "docs" / "a.md", repo=tmp_path)
    assert [p.split(" ")[1].rstrip(":") for p in problems] == [
        "c.md",
        "#same-2",
        "b.md#nope",
        "#not-a-heading",
        "../../outside.md",
    ], problems
