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


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "café au lait\n".encode("latin-1"),
                                     None, "directory"])
def test_refused_input_exits_2_whatever_is_wrong_with_it(tmp_path, capsys, content):
    """One convention, the README's: refused input is exit status 2 (latin-1 text gave 1, as every refusal did)."""
    text = tmp_path / "corpus.txt"
    if content == "directory":
        text.mkdir()
    elif content is not None:  # None: no such file
        text.write_bytes(content)
    out = tmp_path / "out.bin"
    with pytest.raises(SystemExit) as e:
        main(["--text", str(text), "--out", str(out)])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")
    assert not out.exists()


def test_a_write_that_fails_exits_1_and_leaves_no_bin(tmp_path, text, capsys, monkeypatch):
    import errno

    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    out = tmp_path / "out.bin"
    with pytest.raises(SystemExit) as e:
        main(["--text", str(text), "--out", str(out)])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: could not write {out}: disk full"), err
    assert not out.exists()
