"""Tokenize a UTF-8 text file once into token ids for LM training (a thin CLI).

    python -m uvic.lm.prepare --text corpus.txt --tokenizer tokenizer.json --out data/train.bin
    python -m uvic.lm.prepare --text input.txt --tokenizer char --split 0.9 --out data/shakespeare_char

`--tokenizer` is "byte", "char", a tokenizer.json, a sentencepiece .model or a transformers tokenizer directory; ids
are written as uint16 (uint32 with `--dtype uint32` for vocabularies over 65536), the format `uvic.lm.data` reads.
Without `--split`, `--out` is one `.bin` of all the tokens. With `--split F`, `--out` is a folder: `train.bin` holds
the first int(F x n) tokens and `val.bin` the rest, as nanoGPT's data/*/prepare.py write them; "char" (nanoGPT's
shakespeare_char tokenizer: ids into the sorted set of the text's characters) also writes its vocabulary there as
`vocab.json`. `python -m uvic.lm.prepare --text input.txt --tokenizer char --split 0.9 --out DIR` writes train.bin
and val.bin byte for byte as nanoGPT's data/shakespeare_char/prepare.py does.
Bad input (a missing, empty or non-UTF-8 text, an unknown tokenizer or one whose package is not installed, an
output that cannot be written) stops with one `error: ...` line and exit status 2; a write that fails while the
`.bin` is written (disk full) stops with exit status 1 and leaves no partial `.bin`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from uvic.errors import ConfigError, DataError, StorageError, check_writable, cli_errors, storage_errors
from uvic.lm.data import (
    CHAR_VOCAB,
    TOKEN_DTYPES,
    TRAIN_BIN,
    VAL_BIN,
    CharTokenizer,
    encode_text,
    load_tokenizer,
    read_text,
    read_text_tokens,
    split_tokens,
    write_token_bin,
)


logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte', 'char', tokenizer.json, sentencepiece .model or a directory")
    p.add_argument("--out", required=True, help="output .bin file; with --split, the output folder")
    p.add_argument("--split", type=float, default=None,
                   help="write train.bin (the first int(F x n) tokens) and val.bin (the rest) into the --out folder")
    p.add_argument("--dtype", default="uint16", choices=TOKEN_DTYPES)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with cli_errors(status=2):  # refused input (and an output found unwritable before any work): exit status 2
        out = Path(args.out)
        if args.tokenizer == "char" and args.split is None:
            raise ConfigError("--tokenizer char writes a folder (train.bin, val.bin and its vocab.json): pass --split")
        if args.split is not None and not 0 < args.split < 1:
            raise ConfigError(f"--split {args.split}: the train share must lie strictly between 0 and 1 (nanoGPT: 0.9)")
        # The output first, so that a long tokenization never ends in an unwritable path.
        if args.split is None and out.is_dir():
            raise StorageError(f"--out {out} is a directory; pass the path of the .bin file to write")
        if args.split is not None and out.exists() and not out.is_dir():
            raise StorageError(f"--out {out} is a file; with --split, pass the folder to write train.bin and val.bin to")
        check_writable(out if args.split is not None else out.parent, f"--out {out}")
        if args.tokenizer == "char":
            text = read_text(args.text)
            tokenizer = CharTokenizer.from_text(text)
            tokens = encode_text(text, tokenizer)
        else:
            tokenizer = load_tokenizer(args.tokenizer)
            tokens = read_text_tokens(args.text, tokenizer)
        if len(tokens) == 0:  # a .bin of no tokens trains nothing: refused here rather than at training time
            raise DataError(f"--text {args.text} holds no tokens (it is empty); nothing was written")
    with cli_errors(), storage_errors(f"could not write {out}"):  # a write that fails: exit status 1
        if args.split is None:
            write_token_bin(tokens, out, args.dtype)
            logger.info("wrote %d tokens (%s) to %s", len(tokens), args.dtype, out)
            return
        train, val = split_tokens(tokens, args.split)
        out.mkdir(parents=True, exist_ok=True)
        write_token_bin(train, out / TRAIN_BIN, args.dtype)
        write_token_bin(val, out / VAL_BIN, args.dtype)
        if isinstance(tokenizer, CharTokenizer):
            tokenizer.save(out / CHAR_VOCAB)
    logger.info("wrote %d training and %d validation tokens (%s, vocabulary %d) to %s", len(train), len(val),
                args.dtype, len(tokenizer), out)


if __name__ == "__main__":
    main()
