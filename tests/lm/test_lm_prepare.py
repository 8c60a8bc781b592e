"""`python -m uvic.lm.prepare`: bad input ends in one `error: ...` line and a non-zero exit, with nothing written."""

import pytest

from uvic.lm.prepare import main


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("one line\n", encoding="utf-8")
    return path


def test_missing_or_binary_text(tmp_path, cli_error):
    out = tmp_path / "out.bin"
    line = cli_error(main, ["--text", str(tmp_path / "none.txt"), "--out", str(out)])
    assert "none.txt" in line and "does not exist" in line
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    line = cli_error(main, ["--text", str(binary), "--out", str(out)])
    assert "image.txt" in line and "not UTF-8" in line
    line = cli_error(main, ["--text", str(tmp_path), "--out", str(out)])
    assert "is a directory" in line
    assert not out.exists()


def test_output_that_cannot_be_written(tmp_path, text, cli_error):
    line = cli_error(main, ["--text", str(text), "--out", str(tmp_path)])
    assert "is a directory" in line
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = cli_error(main, ["--text", str(text), "--out", str(blocker / "out.bin")])
    assert "cannot write --out" in line and "a file is in the way" in line


def test_unknown_or_unreadable_tokenizer(tmp_path, text, cli_error):
    out = tmp_path / "out.bin"
    line = cli_error(main, ["--text", str(text), "--tokenizer", "gpt2", "--out", str(out)])
    assert "tokenizer 'gpt2' not found" in line
    junk = tmp_path / "tokenizer.json"
    junk.write_text("not json")
    line = cli_error(main, ["--text", str(text), "--tokenizer", str(junk), "--out", str(out)])
    assert "tokenizer.json" in line and "could not be read" in line
    assert not out.exists()


def test_a_sentencepiece_tokenizer_without_the_package_is_one_line(tmp_path, text, cli_error, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` fails, installed or not
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"\x00")
    out = tmp_path / "out.bin"
    line = cli_error(main, ["--text", str(text), "--tokenizer", str(model), "--out", str(out)])
    assert line == (f"error: {model} is a sentencepiece model; install the `sentencepiece` package to use it (or "
                    "convert it to a transformers tokenizer directory / tokenizer.json)")
    assert not out.exists()


def test_an_empty_text_writes_no_bin(tmp_path, cli_error):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out.bin"
    line = cli_error(main, ["--text", str(empty), "--out", str(out)])
    assert line == f"error: --text {empty} holds no tokens (it is empty); nothing was written"
    assert not out.exists()
