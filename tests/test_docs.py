"""Citations of the design notes resolve: every `docs/...` path that code, tests, configs or the README cite is a
file of the repository, and every section of a docs/*.md file cited by its title is a heading of that file (so a
reader can follow it)."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# docs/<name>.md followed by , "<title>" or ("<title>" or , section "<title>" (backticks and escaped quotes
# allowed), and "<title>" in docs/<name>.md.
CITATION_AFTER = re.compile(r'docs/([\w-]+\.md)`?(?:, section |, |\s*\(|\s+)\\?"([^"\\\n]+)\\?"')
CITATION_BEFORE = re.compile(r'"([^"\n]+)" in `?docs/([\w-]+\.md)')
PATH = re.compile(r"\bdocs/[\w-]+(?:/[\w-]+)*\.[A-Za-z]+")


def _sources():
    for folder in ("uvic", "kernels", "fid", "tests", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")
    yield from (ROOT / "configs").glob("*.yaml")
    yield from (ROOT / "docs").glob("*.md")
    yield from (ROOT / name for name in ("README.md", "train.py", "sample.py", "Makefile", "pyproject.toml"))


def _cited_sections() -> dict[tuple[str, str], list[str]]:
    cited = {}
    for path in _sources():
        text, where = path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
        for doc, section in CITATION_AFTER.findall(text):
            cited.setdefault((doc, section), []).append(where)
        for section, doc in CITATION_BEFORE.findall(text):
            cited.setdefault((doc, section), []).append(where)
    return cited


def test_cited_docs_paths_exist():
    cited = {}
    for path in _sources():
        for m in PATH.finditer(path.read_text(encoding="utf-8")):
            cited.setdefault(m.group(0), []).append(path.relative_to(ROOT).as_posix())
    assert {"docs/conventions.md", "docs/attention.md", "docs/kernel_math.md"} <= set(cited)  # the pattern works
    missing = {p: files for p, files in cited.items() if not (ROOT / p).is_file()}
    assert not missing, f"cited docs paths that are not in the repository: {missing}"


def test_cited_sections_exist():
    cited = _cited_sections()
    docs = {doc for doc, _ in cited}
    assert {"conventions.md", "attention.md", "kernel_math.md"} <= docs  # the patterns find the citations at all
    assert sum(doc == "conventions.md" for doc, _ in cited) >= 8
    headings = {doc: {line.lstrip("#").strip() for line in (ROOT / "docs" / doc).read_text().splitlines()
                      if line.startswith("## ")} for doc in docs}  # fmt: skip
    missing = {f"{doc}: {section}": files for (doc, section), files in cited.items() if section not in headings[doc]}
    assert not missing, f"cited sections that the docs do not have: {missing}"
