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


def _readme_snippets() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of the README."""
    lines, out, start = (ROOT / "README.md").read_text(encoding="utf-8").splitlines(), [], None
    for i, line in enumerate(lines, 1):
        if line.strip() == "```python":
            start = i
        elif line.strip() == "```" and start is not None:
            out.append((start, "\n".join(lines[start:i - 1])))
            start = None
    return out


# A snippet that needs what a test cannot have (downloaded weights, a trained run) says so in its first line,
# visibly: "# Needs: ...". Every other snippet runs as written.
NEEDS = "# Needs: "


def test_the_readme_python_snippets_that_need_nothing_run(tmp_path, monkeypatch):
    snippets = _readme_snippets()
    runnable = [(n, code) for n, code in snippets if not code.startswith(NEEDS)]
    assert len(runnable) >= 2 and len(snippets) > len(runnable)  # both kinds are found
    monkeypatch.chdir(tmp_path)
    for n, code in runnable:
        try:
            exec(compile(code, f"README.md:{n}", "exec"), {"__name__": "readme"})
        except Exception as e:  # noqa: BLE001 - report which snippet failed
            raise AssertionError(f"the README snippet at line {n} fails: {type(e).__name__}: {e}") from e


def test_the_readme_snippets_that_need_more_say_what():
    for n, code in _readme_snippets():
        if code.startswith("# Needs"):
            assert code.startswith(NEEDS) and len(code.splitlines()[0]) > len(NEEDS) + 5, f"README.md:{n}"


def test_the_repository_map_points_to_module_docstrings():
    """The README's repository map names paths and sends the reader to each module's docstring: every path it names
    exists, and every Python module under them (the tests aside) opens with a docstring."""
    import ast

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Repository map\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    cells = [row.split(" | ")[0] for row in rows]
    paths = [p for cell in cells for p in re.findall(r"`([^`\s]+)`", cell) if not p.startswith("uvic.")]
    assert len(paths) >= 15 and "uvic/schedulers/" in paths
    assert not [p for p in paths if not (ROOT / p).exists()], "paths in the repository map that do not exist"
    modules = [f for p in paths if p.endswith(("/", ".py")) and p != "tests/" for f in
               ([ROOT / p] if p.endswith(".py") else (ROOT / p).rglob("*.py"))]  # fmt: skip
    assert len(modules) > 50
    bare = [f.relative_to(ROOT).as_posix() for f in modules if not ast.get_docstring(ast.parse(f.read_text()))]
    assert not bare, f"modules without a docstring: {bare}"
