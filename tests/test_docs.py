"""Relative links in README.md and docs/*.md resolve: the target exists, and an anchor into a
markdown file names one of its headings (GitHub's slugs). CPU only, no network."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or [text](target "title"); the text may hold one level of brackets
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # the text
    r"\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"  # (target "title")
)
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def prose_lines(text):
    """(line number, line) for every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor a markdown file defines: its headings' slugs, duplicates numbered -1, -2."""
    seen = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path):
    """(line number, target) for every link outside code (fenced blocks and inline spans)."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        reference = REFERENCE_DEF.match(line)
        if reference:
            yield number, reference.group(1)
            continue
        for match in INLINE_LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def broken_links(path, root=ROOT):
    """A message for each relative link in `path` that does not resolve."""
    problems = []
    for number, target in links(path):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http(s), mailto and other schemes are not checked
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: link '{target}'"
        if not resolved.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        is_markdown = resolved.is_file() and resolved.suffix == ".md"
        if anchor and is_markdown and unquote(anchor) not in anchors(resolved):
            name = resolved.relative_to(root) if resolved.is_relative_to(root) else resolved
            problems.append(f"{where}: {name} has no heading with anchor '#{anchor}'")
    return problems


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_docs_pages_exist():
    assert len(DOC_FILES) > 1, "no docs/*.md found beside README.md"


def test_slug_follows_github():
    assert slug("Known issue: float8 copies in two layouts on Hopper") == (
        "known-issue-float8-copies-in-two-layouts-on-hopper"
    )
    assert slug("End to end: examples/train_llama.py") == "end-to-end-examplestrain_llamapy"
    assert slug("SwiGLU's inputs in float8 (experimental: less memory, higher loss)") == (
        "swiglus-inputs-in-float8-experimental-less-memory-higher-loss"
    )
    assert slug("Set-up: two commands") == "set-up-two-commands"


def test_checker_reports_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## Part\n\n## Part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#part-1) [ok](#page) [web](https://example.com/x.md)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n\n"
        "```\n[in code](missing-too.md)\n```\n`[inline](missing-three.md)`\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "page.md:4: link 'missing.md': missing.md does not exist" in problems[0]
    assert "other.md has no heading with anchor '#nowhere'" in problems[1]
