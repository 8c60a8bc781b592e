"""The style rules that `ruff check` cannot see (docs/where_to_change.md, "Code style")."""

from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
MARKER = "# fmt: " + "skip"  # written in two parts so that this file does not hold the marker itself


def test_no_formatter_markers_outside_kernels():
    """No formatter runs on the project, so a marker that skips one only adds noise; kernels/ keeps its markers
    (its source is part of Triton's cache keys, and an edit there recompiles every kernel)."""
    found = [f"{path.relative_to(ROOT)}:{i}" for folder in ("uvic", "fid", "tests", "benchmarks", "configs")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if MARKER in line]
    found += [f"{name}:{i}" for name in ("train.py", "sample.py", "compare.py")
              for i, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1) if MARKER in line]
    assert not found, f"formatter markers outside kernels/: {found[:10]}"
    assert any(MARKER in line for line in (ROOT / "kernels" / "attention.py").read_text().splitlines())  # the check reads
