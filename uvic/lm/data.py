"""Token data for language-model training: pre-tokenized `.bin` files, text files, and the tokenizers for them.

Three on-disk sources:
  * a pre-tokenized binary file: a flat array of token ids, uint16 by default (the nanoGPT / Megatron
    "common" format), read through `np.memmap` so corpora larger than RAM work;
  * a prepared folder (`python -m uvic.lm.prepare --split`): `train.bin` and `val.bin`, as nanoGPT's
    `data/*/prepare.py` write them, and for the character tokenizer its vocabulary `vocab.json`
    (`load_split_tokens`);
  * a UTF-8 text file, tokenized on load with a tokenizer the user points to: a `tokenizer.json`
    (Hugging Face `tokenizers`), a sentencepiece `.model` (needs the `sentencepiece` package), a saved
    transformers tokenizer directory, or `"byte"`, the built-in byte-level tokenizer (ids 0-255 are the UTF-8
    bytes, 256 is end-of-text) that needs no files and is used by the tests and the CPU demo, or a character
    vocabulary `vocab.json` (`CharTokenizer`, nanoGPT's shakespeare_char tokenizer).

`TokenDataset` cuts the flat token array into fixed-length windows; a batch is `{"input_ids": (B, L)}` and the
model shifts the labels (position t predicts token t + 1).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from uvic.errors import DataError, MissingPackageError
from uvic.io import atomic_write


logger = logging.getLogger(__name__)

# The element types of a `.bin` of token ids (the choices of `data.token_dtype` and `prepare --dtype`).
TOKEN_DTYPES = ("uint16", "uint32")
BYTE_VOCAB_SIZE = 257  # 256 byte values + the end-of-text id
BYTE_EOS_ID = 256
_TEXT_CHUNK_CHARS = 1 << 20  # tokenize large text files in ~1M-character pieces, split at line ends
# The files of a prepared folder (`uvic.lm.prepare --split`), named as nanoGPT's data/*/prepare.py names its .bin.
TRAIN_BIN, VAL_BIN, CHAR_VOCAB = "train.bin", "val.bin", "vocab.json"


def _bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-character table of GPT-2's byte-level BPE (as `tokenizers.ByteLevel`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """A transformers fast tokenizer whose ids are the UTF-8 bytes (0-255) plus `<|endoftext|>` = 256.

    It is a real `PreTrainedTokenizerFast` (a byte-level BPE with no merges), so `save_pretrained` writes it next to
    the model and lm-evaluation-harness / `AutoTokenizer` load it like any other tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos)
    if fast.convert_tokens_to_ids(eos) != BYTE_EOS_ID or len(fast) != BYTE_VOCAB_SIZE:
        raise RuntimeError(f"byte tokenizer layout changed: eos id {fast.convert_tokens_to_ids(eos)}, size {len(fast)}")
    return fast


class _SentencePieceTokenizer:
    """The two calls `encode_text` needs, over a sentencepiece model file."""

    def __init__(self, path: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise MissingPackageError(
                f"{path} is a sentencepiece model; install the `sentencepiece` package to use it "
                "(or convert it to a transformers tokenizer directory / tokenizer.json)"
            ) from None
        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_token_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    def __len__(self) -> int:
        return self.vocab_size


class CharTokenizer:
    """A character-level tokenizer, nanoGPT's (data/shakespeare_char/prepare.py): id i is the i-th character of
    `chars`, the sorted set of the characters of the whole text (`from_text`); no special tokens.

    Saved as JSON (`save`: `{"tokenizer": "char", "chars": [...]}`), never a pickle (nanoGPT's meta.pkl).
    """

    eos_token_id = None

    def __init__(self, chars: list[str] | str) -> None:
        chars = list(chars)
        if not chars or any(not isinstance(c, str) or len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("a character vocabulary is a non-empty list of distinct single characters")
        self.chars = chars
        self.ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The vocabulary of `text`: its distinct characters in code-point order (Python's `sorted(set(text))`)."""
        return cls(sorted(set(text)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        """The tokenizer `save` wrote to `path` (JSON); a DataError naming `path` if it is not one."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("tokenizer") != "char":
                raise ValueError('no "tokenizer": "char" entry')
            return cls(data["chars"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise DataError(f"{path} is not a character vocabulary written by uvic.lm.prepare: {err}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON, atomically."""
        with atomic_write(path) as f:
            f.write(json.dumps({"tokenizer": "char", "chars": self.chars}, ensure_ascii=False).encode("utf-8"))

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Save as `out_dir/vocab.json` (the LM task's export calls this, as it does a transformers tokenizer's)."""
        self.save(Path(out_dir) / CHAR_VOCAB)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return [self.ids[c] for c in text]
        except KeyError as err:
            raise DataError(f"character {err.args[0]!r} is not in the character vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def __len__(self) -> int:
        return len(self.chars)


def _is_char_vocab(path: Path) -> bool:
    """Whether the JSON file `path` is a `CharTokenizer` vocabulary (anything else is left to `tokenizers`)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON or not UTF-8; `tokenizers` names the problem
        return False
    return isinstance(data, dict) and data.get("tokenizer") == "char"


def load_tokenizer(spec: str) -> Any:
    """A tokenizer from `spec`: "byte", a `tokenizer.json`, a character `vocab.json` (`CharTokenizer`), a
    sentencepiece `.model`, or a tokenizer directory.

    The result has `encode(text, add_special_tokens=False) -> list[int]`, `decode(ids)` and `len()`.
    """
    if spec == "byte":
        return byte_tokenizer()
    if spec == "char":
        raise ValueError("the 'char' tokenizer is made from a text by `python -m uvic.lm.prepare --tokenizer char`; "
                         "pass the vocab.json it writes")
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer {spec!r} not found: pass 'byte', a tokenizer.json, a sentencepiece .model file, "
            "or a directory saved with save_pretrained"
        )
    if path.suffix not in (".json", ".model") and not path.is_dir():
        raise ValueError(f"cannot tell the tokenizer type of {spec!r}: expected 'byte', *.json, *.model or a directory")
    try:
        if path.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if path.suffix == ".json" and _is_char_vocab(path):
            return CharTokenizer.load(path)
        if path.suffix == ".json":
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        return _SentencePieceTokenizer(str(path))
    except ImportError:
        raise
    except Exception as err:  # the tokenizer libraries raise bare Exception / OSError / RuntimeError for bad files
        raise DataError(f"tokenizer {spec!r} could not be read: {err}") from err


def token_dtype(name: str) -> np.dtype:
    """The numpy dtype of a `.bin` of token ids; `name` must be one of `TOKEN_DTYPES`."""
    if name not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype {name!r} is not one of {list(TOKEN_DTYPES)}: token ids are stored as "
                         "unsigned integers, uint16 for vocabularies up to 65536")
    return np.dtype(name)


def _vocab_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_text(text: str, tokenizer: Any) -> np.ndarray:
    """Token ids of `text` as a 1-D uint16 (uint32 for vocabularies over 65536) array; no special tokens added."""
    ids: list[int] = []
    start = 0
    while start < len(text):  # pieces end at a newline so a BPE merge never straddles two pieces
        end = min(len(text), start + _TEXT_CHUNK_CHARS)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        ids.extend(tokenizer.encode(text[start:end], add_special_tokens=False))
        start = end
    return np.asarray(ids, dtype=_vocab_dtype(len(tokenizer)))


def read_text(path: str | os.PathLike) -> str:
    """The contents of a UTF-8 text file; a DataError naming `path` if it is not one."""
    path = Path(path)
    _check_is_file(path, "text file", "a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); pass a UTF-8 text file, "
                        "or a .bin of token ids") from None


def read_text_tokens(path: str | os.PathLike, tokenizer: Any) -> np.ndarray:
    """Read a UTF-8 text file and tokenize it (see `encode_text`)."""
    return encode_text(read_text(path), tokenizer)


def _check_is_file(path: Path, what: str, expected: str) -> None:
    if path.is_dir():
        raise DataError(f"{what} {path} is a directory; expected {expected}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist (expected {expected})")


def write_token_bin(tokens: np.ndarray, path: str | os.PathLike, dtype: str = "uint16") -> None:
    """Write token ids as a flat binary file of `dtype` (readable by `read_token_bin`), atomically: a failed write
    leaves `path` as it was."""
    dt = token_dtype(dtype)
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) > np.iinfo(dt).max:
        raise ValueError(f"token id {int(tokens.max())} does not fit in {dt}; write with dtype='uint32'")
    with atomic_write(path) as f:
        tokens.astype(dt, copy=False).tofile(f)


def read_token_bin(path: str | os.PathLike, dtype: str = "uint16") -> np.ndarray:
    """Memory-map a flat binary file of token ids (nanoGPT-style `.bin`) as a read-only 1-D array."""
    path = Path(path)
    itemsize = token_dtype(dtype).itemsize
    _check_is_file(path, "token file", f"a flat {dtype} array of token ids")
    if path.stat().st_size == 0:  # np.memmap refuses it without naming the file
        raise DataError(f"token file {path} is empty: it holds no token ids")
    if path.stat().st_size % itemsize:
        raise ValueError(f"{path} has {path.stat().st_size} bytes, not a multiple of the {dtype} size {itemsize}")
    return np.memmap(path, dtype=dtype, mode="r")


def load_tokens(path: str | os.PathLike, fmt: str = "auto", tokenizer: str = "byte", dtype: str = "uint16") -> np.ndarray:
    """Token ids from a `.bin` file (`fmt="bin"`) or a text file tokenized with `tokenizer` (`fmt="text"`).

    `fmt="auto"` picks "bin" for a `.bin` suffix and "text" otherwise. `dtype` is the `.bin` element type, checked
    whatever the format.
    """
    token_dtype(dtype)
    if fmt == "auto":
        fmt = "bin" if Path(path).suffix == ".bin" else "text"
    if fmt == "bin":
        return read_token_bin(path, dtype)
    if fmt == "text":
        try:
            return read_text_tokens(path, load_tokenizer(tokenizer))
        except DataError as e:
            if Path(path).suffix != ".bin" or "not UTF-8" not in str(e):
                raise
            raise DataError(f"{e}; {path} is named like a .bin of token ids, which the format 'text' (data.format) "
                            "does not read: use format 'bin', or 'auto', which goes by the suffix") from None
    raise ValueError(f"unknown token data format {fmt!r}; expected 'auto', 'bin' or 'text'")


def split_tokens(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The first int(fraction x n) tokens and the rest (nanoGPT's `data[:int(n*0.9)]`, `data[int(n*0.9):]`)."""
    if not 0 < fraction < 1:
        raise ValueError(f"the train share must lie strictly between 0 and 1, got {fraction}")
    cut = int(len(tokens) * fraction)
    if cut == 0 or cut == len(tokens):
        raise DataError(f"a split at {fraction} of {len(tokens)} tokens leaves one side empty")
    return tokens[:cut], tokens[cut:]


def is_prepared_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder (the data of a prepared folder, `load_split_tokens`, rather than a file)."""
    return Path(path).is_dir()


def load_split_tokens(folder: str | os.PathLike, dtype: str = "uint16") -> tuple[np.ndarray, np.ndarray]:
    """The training and validation token ids of a prepared folder: its `train.bin` and `val.bin` (memory-mapped)."""
    folder = Path(folder)
    missing = [name for name in (TRAIN_BIN, VAL_BIN) if not (folder / name).is_file()]
    if missing:
        raise DataError(f"data folder {folder} has no {' or '.join(missing)}: a data folder is what "
                        "`python -m uvic.lm.prepare --split F --out DIR` writes (train.bin, val.bin)")
    return read_token_bin(folder / TRAIN_BIN, dtype), read_token_bin(folder / VAL_BIN, dtype)


def folder_tokenizer(folder: str | os.PathLike) -> str | None:
    """The vocabulary file of a prepared folder (`vocab.json`), if it has one."""
    vocab = Path(folder) / CHAR_VOCAB
    return str(vocab) if vocab.is_file() else None


class TokenDataset(Dataset):
    """Fixed-length windows over a flat token array.

    Window i is `tokens[i * stride : i * stride + block_size]`; the default stride is `block_size`
    (non-overlapping, every token seen once per epoch). Items are `{"input_ids": (block_size,) int64}`.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, stride: int | None = None) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be at least 2 (one input and one target), got {block_size}")
        self.stride = block_size if stride is None else stride
        if self.stride < 1:
            raise ValueError(f"stride must be positive, got {self.stride}")
        if len(tokens) < block_size:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than one block of {block_size}")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.stride
        window = np.asarray(self.tokens[start : start + self.block_size], dtype=np.int64)
        return {"input_ids": torch.from_numpy(window)}


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats) of the empirical unigram distribution of `tokens`: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
