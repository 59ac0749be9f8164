"""Run the ```python blocks of docs/**/*.md (the notes under docs/notes/ too), so the docs cannot rot
(STYLE.md habit 8).

The blocks of one page run in order in one namespace, like a notebook: a later
block may use names an earlier one defined.  A block written as a doctest
(lines starting with ``>>>``) has its printed output checked as well; any other
block must simply run without raising (put ``assert`` lines in it to make a
claim checkable).  Blocks fenced as anything but ``python`` (pseudocode, shell,
text) are not run.  A page may opt a block out with ``<!-- docs-test: skip -->``
on the line just before the fence; the skip is reported.
"""
import doctest
import linecache
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
ALL_PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<info>[^\n`]*)$")
SKIP_MARK = "<!-- docs-test: skip -->"


def python_blocks(text: str):
    """[(first line number, source, skipped)] for each fenced block whose info string starts with 'python'."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, indent = match["fence"], match["info"].strip(), len(match["indent"])
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        i += 1                                                     # the closing fence
        if info.split()[:1] in (["python"], ["py"], ["python3"]) or info.startswith("{python"):
            skipped = start >= 2 and lines[start - 2].strip() == SKIP_MARK
            blocks.append((start + 1, "\n".join(body) + "\n", skipped))
    return blocks


def test_block_parser_finds_blocks():
    """The parser itself: it must find python blocks (else every page would pass vacuously)."""
    text = "x\n```python\na = 1\n```\n```\nnot python\n```\n<!-- docs-test: skip -->\n```py\nb = 2\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (10, "b = 2\n", True)]


# only pages with code to run (a page of prose only has nothing to check here)
PAGES = [p for p in ALL_PAGES if python_blocks(p.read_text(encoding="utf-8"))]


def test_some_pages_have_code():
    assert len(PAGES) >= 2, [str(p.relative_to(DOCS)) for p in ALL_PAGES]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_doc_page_python_blocks_run(page, monkeypatch):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    monkeypatch.chdir(DOCS.parent)                                 # pages may refer to repo-relative paths
    namespace = {"__name__": "docs." + ".".join(page.relative_to(DOCS).with_suffix("").parts)}
    skipped = 0
    for line, source, skip in blocks:
        if skip:
            skipped += 1
            continue
        where = f"{page.relative_to(DOCS.parent)}:{line}"
        if source.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(source, namespace, where, str(page), line - 1)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            failed = runner.summarize(verbose=False).failed
            assert failed == 0, f"{where}: {failed} doctest example(s) failed (output above)"
        else:
            try:
                # the block's source where inspect finds it, as a notebook's cells are (flashnb reads a score_mod's
                # source to take its gradient into captured arrays)
                linecache.cache[where] = (len(source), None, source.splitlines(True), where)
                exec(compile(source, where, "exec"), namespace)
            except Exception as exc:                               # name the block in the failure
                raise AssertionError(f"python block at {where} raised {type(exc).__name__}: {exc}") from exc
    assert skipped < len(blocks), f"{page.relative_to(DOCS)}: every python block is marked skip"
