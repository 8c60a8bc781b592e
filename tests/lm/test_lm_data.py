"""Token data: the byte tokenizer, .bin files, text files with a user tokenizer, and the window dataset."""

from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from transformers import AutoTokenizer

from uvic.lm.data import (
    BYTE_EOS_ID,
    TokenDataset,
    byte_tokenizer,
    encode_text,
    load_tokenizer,
    load_tokens,
    read_token_bin,
    unigram_entropy,
    write_token_bin,
)


TEXT = "Cog attention, négatif: 🙂\n\ttabs and\x00 nulls\nline three\n"


def test_byte_tokenizer_ids_are_utf8_bytes(tmp_path):
    tok = byte_tokenizer()
    ids = encode_text(TEXT, tok)
    assert ids.dtype == np.uint16
    assert ids.tolist() == list(TEXT.encode("utf-8"))
    assert tok.decode(ids.tolist()) == TEXT
    assert tok.eos_token_id == BYTE_EOS_ID == len(tok) - 1
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(TEXT, add_special_tokens=False) == list(TEXT.encode("utf-8"))
    assert load_tokenizer(str(tmp_path)).encode(TEXT, add_special_tokens=False) == list(TEXT.encode("utf-8"))


def test_text_file_with_tokenizer_json(tmp_path):
    """A user's tokenizers-library tokenizer.json tokenizes the file exactly as the tokenizers library does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.split())) + ["[UNK]"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(TEXT * 3, encoding="utf-8")
    got = load_tokens(tmp_path / "corpus.txt", tokenizer=str(tmp_path / "tokenizer.json"))
    assert got.tolist() == raw.encode(TEXT * 3).ids


def test_bin_round_trip_and_memmap(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 32000, size=1000)
    write_token_bin(tokens, tmp_path / "train.bin")
    assert (tmp_path / "train.bin").stat().st_size == 2000  # uint16
    got = load_tokens(tmp_path / "train.bin")
    assert isinstance(got, np.memmap) and got.tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="does not fit in uint16"):
        write_token_bin(np.array([70000]), tmp_path / "big.bin")
    write_token_bin(np.array([70000, 1]), tmp_path / "big.bin", dtype="uint32")
    assert read_token_bin(tmp_path / "big.bin", "uint32").tolist() == [70000, 1]
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="not a multiple"):
        read_token_bin(tmp_path / "odd.bin")


def test_missing_files_and_bad_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(tmp_path / "none.bin")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(tmp_path / "none.txt")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "tok.json"))
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown token data format"):
        load_tokens(tmp_path / "t.txt", fmt="parquet")


def test_sentencepiece_model_needs_the_package(tmp_path):
    pytest.importorskip("tokenizers")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        (tmp_path / "tokenizer.model").write_bytes(b"\x00")
        with pytest.raises(ImportError, match="install the `sentencepiece` package"):
            load_tokenizer(str(tmp_path / "tokenizer.model"))
    else:
        pytest.skip("sentencepiece is installed; the missing-package message does not apply")


def test_an_empty_bin_is_named(tmp_path):
    from uvic.errors import DataError

    (tmp_path / "empty.bin").write_bytes(b"")
    for fmt in ("bin", "auto"):
        with pytest.raises(DataError, match=f"^token file {tmp_path / 'empty.bin'} is empty: it holds no token ids$"):
            load_tokens(tmp_path / "empty.bin", fmt=fmt)


def test_a_bin_read_as_text_says_which_format_reads_it(tmp_path):
    from uvic.errors import DataError

    write_token_bin(np.array([0xFFFF, 1]), tmp_path / "ids.bin")  # 0xff is no UTF-8 byte
    with pytest.raises(DataError, match=r"is not UTF-8 text .*; .*ids.bin is named like a .bin of token ids, which "
                                        r"the format 'text' \(data.format\) does not read: use format 'bin', or "
                                        r"'auto'"):
        load_tokens(tmp_path / "ids.bin", fmt="text")


def test_the_tiny_lm_config_trains_on_a_prepared_bin(tmp_path):
    """The LM journey of docs/language_models.md: `python -m uvic.lm.prepare` writes a .bin, and configs/lm_tiny.yaml reads it as
    token ids (the format follows the suffix) without a data.format override."""
    from uvic.config import load_config
    from uvic.lm.prepare import main
    from uvic.training.tasks.lm import build_dataset

    (tmp_path / "c.txt").write_text(TEXT * 8, encoding="utf-8")
    main(["--text", str(tmp_path / "c.txt"), "--out", str(tmp_path / "c.bin")])
    root = Path(__file__).resolve().parents[2]
    for path in ("c.bin", "c.txt"):
        cfg = load_config(root / "configs" / "lm_tiny.yaml", [f"data.path={tmp_path / path}"])
        assert build_dataset(cfg.data).tokens.tolist() == list((TEXT * 8).encode("utf-8"))


def test_token_dataset_windows():
    tokens = np.arange(100, dtype=np.uint16)
    ds = TokenDataset(tokens, block_size=16)
    assert len(ds) == 6  # floor((100 - 16) / 16) + 1
    assert ds[2]["input_ids"].tolist() == list(range(32, 48))
    overlap = TokenDataset(tokens, block_size=16, stride=8)
    assert len(overlap) == 11 and overlap[10]["input_ids"].tolist() == list(range(80, 96))
    with pytest.raises(IndexError):
        ds[6]
    with pytest.raises(ValueError, match="fewer than one block"):
        TokenDataset(tokens[:10], block_size=16)


def test_unigram_entropy_matches_scipy():
    tokens = np.random.default_rng(1).integers(0, 50, size=5000)
    assert unigram_entropy(tokens) == pytest.approx(scipy.stats.entropy(np.bincount(tokens)), rel=1e-12)


def test_prepare_cli_writes_a_bin_that_loads_back(tmp_path):
    from uvic.lm.prepare import main

    (tmp_path / "c.txt").write_text(TEXT, encoding="utf-8")
    main(["--text", str(tmp_path / "c.txt"), "--out", str(tmp_path / "c.bin")])
    assert load_tokens(tmp_path / "c.bin").tolist() == list(TEXT.encode("utf-8"))


def test_token_dtype_must_be_a_token_id_type(tmp_path):
    path = tmp_path / "t.bin"
    write_token_bin(np.arange(10), path)
    (tmp_path / "t.txt").write_text("x")
    for source in (path, tmp_path / "t.txt"):  # refused whatever the format, as a config value
        with pytest.raises(ValueError, match="token_dtype 'foo' is not one of"):
            load_tokens(source, dtype="foo")
    # float32 would read the ids' bytes as floats (NaN and garbage ids), int8 as negative ids.
    for dtype in ("float32", "int8"):
        with pytest.raises(ValueError, match=f"token_dtype '{dtype}' is not one of"):
            load_tokens(path, dtype=dtype)
    assert load_tokens(path, dtype="uint16").tolist() == list(range(10))


def test_data_path_that_is_a_directory(tmp_path):
    from uvic.errors import DataError

    for fmt in ("bin", "text", "auto"):
        with pytest.raises(DataError, match="is a directory"):
            load_tokens(tmp_path, fmt=fmt)


def test_config_refuses_a_token_dtype_that_is_not_one():
    from uvic.config import load_config
    from uvic.errors import ConfigError

    config = Path(__file__).parents[2] / "configs" / "lm_tiny.yaml"
    for dtype in ("foo", "float32"):
        with pytest.raises(ConfigError, match=f"data.token_dtype: '{dtype}' is not one of"):
            load_config(config, [f"data.token_dtype={dtype}"])
    assert load_config(config, ["data.token_dtype=uint32"]).data.token_dtype == "uint32"


def test_char_vocabulary_files(tmp_path):
    """A character vocab.json loads as a CharTokenizer; a broken one is named; other JSON is left to tokenizers."""
    import json

    from uvic.errors import DataError
    from uvic.lm.data import CharTokenizer

    good = tmp_path / "vocab.json"
    CharTokenizer.from_text("banana\n").save(good)
    assert json.loads(good.read_text()) == {"tokenizer": "char", "chars": ["\n", "a", "b", "n"]}
    tok = load_tokenizer(str(good))
    assert tok.encode("nab\n") == [3, 1, 2, 0] and tok.decode([2, 1, 3]) == "ban" and len(tok) == 4
    with pytest.raises(DataError, match="character 'z' is not in the character vocabulary"):
        tok.encode("zebra")
    bad = tmp_path / "dup.json"
    bad.write_text(json.dumps({"tokenizer": "char", "chars": ["a", "a"]}))
    with pytest.raises(DataError, match="dup.json is not a character vocabulary written by uvic.lm.prepare"):
        load_tokenizer(str(bad))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"chars": ["a"]}))
    with pytest.raises(DataError, match="other.json' could not be read"):  # the tokenizers library's turn
        load_tokenizer(str(other))
    with pytest.raises(ValueError, match="the 'char' tokenizer is made from a text"):
        load_tokenizer("char")
