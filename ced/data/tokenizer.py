"""Byte-level tokenizer: the 256 UTF-8 byte values plus three specials (vocab_size 259)."""

from __future__ import annotations

from typing import Iterable


class ByteTokenizer:
    """UTF-8 bytes 0..255, BOS=256, EOS=257, PAD=258.

    encode("hé") -> [104, 195, 169]; decode skips the specials and replaces invalid UTF-8.
    """

    vocab_size = 259
    bos = 256
    eos = 257
    pad = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        if hasattr(ids, "tolist"):             # torch.Tensor / numpy array
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
