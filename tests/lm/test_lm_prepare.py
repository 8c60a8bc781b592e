"""`python -m uvic.lm.prepare`: bad input ends in one `error: ...` line and a non-zero exit, with nothing written."""

import pytest

from uvic.lm.prepare import main


def _error_line(capsys, argv: list[str]) -> str:
    """Run the CLI on `argv`, which must fail; returns its single stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code not in (0, None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("one line\n", encoding="utf-8")
    return path


def test_missing_or_binary_text(tmp_path, capsys):
    out = tmp_path / "out.bin"
    line = _error_line(capsys, ["--text", str(tmp_path / "none.txt"), "--out", str(out)])
    assert "none.txt" in line and "does not exist" in line
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    line = _error_line(capsys, ["--text", str(binary), "--out", str(out)])
    assert "image.txt" in line and "not UTF-8" in line
    line = _error_line(capsys, ["--text", str(tmp_path), "--out", str(out)])
    assert "is a directory" in line
    assert not out.exists()


def test_output_that_cannot_be_written(tmp_path, text, capsys):
    line = _error_line(capsys, ["--text", str(text), "--out", str(tmp_path)])
    assert "is a directory" in line
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _error_line(capsys, ["--text", str(text), "--out", str(blocker / "out.bin")])
    assert "cannot write --out" in line and "a file is in the way" in line


def test_unknown_or_unreadable_tokenizer(tmp_path, text, capsys):
    out = tmp_path / "out.bin"
    line = _error_line(capsys, ["--text", str(text), "--tokenizer", "gpt2", "--out", str(out)])
    assert "tokenizer 'gpt2' not found" in line
    junk = tmp_path / "tokenizer.json"
    junk.write_text("not json")
    line = _error_line(capsys, ["--text", str(text), "--tokenizer", str(junk), "--out", str(out)])
    assert "tokenizer.json" in line and "could not be read" in line
    assert not out.exists()
