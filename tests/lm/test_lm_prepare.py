"""`python -m uvic.lm.prepare`: bad input ends in one `error: ...` line and a non-zero exit, with nothing written."""

import numpy as np
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


# A made-up text with characters outside ASCII (sorted by code point: "\n" < " " < ... < "é" < "🙂").
CHAR_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak! Café 🙂 x3;\n" * 7


def nanogpt_rule(text: str, split: float) -> tuple[bytes, bytes, list[str]]:
    """nanoGPT's data/shakespeare_char/prepare.py rule, written out independently: the sorted set of the text's
    characters, each character's index in it as uint16 (little-endian, numpy's tofile on x86/ARM), the first
    int(n x split) characters for training and the rest for validation."""
    chars = sorted(set(text))
    ids = [chars.index(c) for c in text]
    cut = int(len(text) * split)
    pack = lambda xs: b"".join(int(i).to_bytes(2, "little") for i in xs)  # noqa: E731
    return pack(ids[:cut]), pack(ids[cut:]), chars


def test_char_split_writes_nanogpts_bytes(tmp_path):
    import json

    from uvic.lm.data import load_split_tokens, load_tokenizer

    text = tmp_path / "input.txt"
    text.write_text(CHAR_TEXT, encoding="utf-8")
    out = tmp_path / "data" / "chars"
    main(["--text", str(text), "--tokenizer", "char", "--split", "0.9", "--out", str(out)])
    train, val, chars = nanogpt_rule(CHAR_TEXT, 0.9)
    assert (out / "train.bin").read_bytes() == train
    assert (out / "val.bin").read_bytes() == val
    assert len(train) // 2 == int(len(CHAR_TEXT) * 0.9)  # characters, not UTF-8 bytes: "🙂" is one id
    assert json.loads((out / "vocab.json").read_text(encoding="utf-8")) == {"tokenizer": "char", "chars": chars}
    tok = load_tokenizer(str(out / "vocab.json"))
    train_ids, val_ids = load_split_tokens(out)
    assert len(tok) == len(chars) and tok.decode(list(train_ids) + list(val_ids)) == CHAR_TEXT
    assert tok.encode("Café") == [chars.index(c) for c in "Café"]


def test_split_with_another_tokenizer_and_the_single_bin_form(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text(CHAR_TEXT, encoding="utf-8")
    raw = list(CHAR_TEXT.encode("utf-8"))  # the byte tokenizer's ids
    main(["--text", str(text), "--split", "0.5", "--out", str(tmp_path / "bytes")])
    cut = len(raw) // 2
    assert np.fromfile(tmp_path / "bytes" / "train.bin", np.uint16).tolist() == raw[:cut]
    assert np.fromfile(tmp_path / "bytes" / "val.bin", np.uint16).tolist() == raw[cut:]
    assert not (tmp_path / "bytes" / "vocab.json").exists()
    main(["--text", str(text), "--out", str(tmp_path / "all.bin")])
    assert np.fromfile(tmp_path / "all.bin", np.uint16).tolist() == raw


def test_split_refusals(tmp_path, text, cli_error):
    out = tmp_path / "out"
    line = cli_error(main, ["--text", str(text), "--tokenizer", "char", "--out", str(out)])
    assert line == "error: --tokenizer char writes a folder (train.bin, val.bin and its vocab.json): pass --split"
    for split in ("0", "1", "1.5"):
        line = cli_error(main, ["--text", str(text), "--tokenizer", "char", "--split", split, "--out", str(out)])
        assert line.startswith(f"error: --split {float(split)}: the train share must lie strictly between 0 and 1")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = cli_error(main, ["--text", str(text), "--tokenizer", "char", "--split", "0.9", "--out", str(blocker)])
    assert line == f"error: --out {blocker} is a file; with --split, pass the folder to write train.bin and val.bin to"
    one = tmp_path / "one.txt"
    one.write_text("a")
    line = cli_error(main, ["--text", str(one), "--tokenizer", "char", "--split", "0.9", "--out", str(out)])
    assert line == "error: a split at 0.9 of 1 tokens leaves one side empty"
    assert not out.exists() or not any(out.iterdir())
