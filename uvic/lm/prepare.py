"""Tokenize a UTF-8 text file once into a flat `.bin` of token ids for LM training (a thin CLI).

    python -m uvic.lm.prepare --text corpus.txt --tokenizer tokenizer.json --out data/train.bin

`--tokenizer` is "byte", a tokenizer.json, a sentencepiece .model or a transformers tokenizer directory; ids are
written as uint16 (uint32 with `--dtype uint32` for vocabularies over 65536), the format `uvic.lm.data` reads.
Bad input (a missing, empty or non-UTF-8 text, an unknown tokenizer or one whose package is not installed, an
output that cannot be written) stops with one `error: ...` line and exit status 2; a write that fails while the
`.bin` is written (disk full) stops with exit status 1 and leaves no partial `.bin`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from uvic.errors import DataError, StorageError, check_writable, cli_errors, storage_errors
from uvic.lm.data import TOKEN_DTYPES, load_tokenizer, read_text_tokens, write_token_bin


logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--tokenizer", default="byte", help="'byte', tokenizer.json, sentencepiece .model or a directory")
    p.add_argument("--out", required=True, help="output .bin file")
    p.add_argument("--dtype", default="uint16", choices=TOKEN_DTYPES)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with cli_errors(status=2):  # refused input (and an output found unwritable before any work): exit status 2
        out = Path(args.out)
        # The output first, so that a long tokenization never ends in an unwritable path.
        if out.is_dir():
            raise StorageError(f"--out {out} is a directory; pass the path of the .bin file to write")
        check_writable(out.parent, f"--out {out}")
        tokenizer = load_tokenizer(args.tokenizer)
        tokens = read_text_tokens(args.text, tokenizer)
        if len(tokens) == 0:  # a .bin of no tokens trains nothing: refused here rather than at training time
            raise DataError(f"--text {args.text} holds no tokens (it is empty); nothing was written")
    with cli_errors(), storage_errors(f"could not write {out}"):  # a write that fails: exit status 1
        write_token_bin(tokens, out, args.dtype)
    logger.info("wrote %d tokens (%s) to %s", len(tokens), args.dtype, out)


if __name__ == "__main__":
    main()
