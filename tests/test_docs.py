"""Citations of the design notes resolve: every section of docs/conventions.md that code, tests or the README cite
by its title is a heading of that file (so a reader can follow it)."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r'docs/conventions\.md(?:, |\s*\(|\s+)\\?"([^"\\]+)\\?"')


def _sources():
    for folder in ("uvic", "kernels", "fid", "tests"):
        yield from (ROOT / folder).rglob("*.py")
    yield from (ROOT / "docs").glob("*.md")
    yield ROOT / "README.md"


def test_cited_convention_sections_exist():
    headings = {line[3:].strip() for line in (ROOT / "docs" / "conventions.md").read_text().splitlines()
                if line.startswith("## ")}
    cited = {}
    for path in _sources():
        for m in CITATION.finditer(path.read_text(encoding="utf-8")):
            cited.setdefault(m.group(1), []).append(path.relative_to(ROOT).as_posix())
    assert len(cited) >= 8  # the pattern finds the citations at all
    missing = {section: files for section, files in cited.items() if section not in headings}
    assert not missing, f"cited sections that docs/conventions.md does not have: {missing}"
