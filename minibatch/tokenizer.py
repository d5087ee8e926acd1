"""Tokenizer loading and incremental detokenization (for streaming and stop strings)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """A ``transformers`` tokenizer from a local directory, or ``None`` if it has none.

    A checkpoint without tokenizer files still serves token-id prompts.
    """
    path = Path(path)
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, one call per new token.

    Decoding token by token breaks multi-byte characters (a Chinese character can span
    several byte-level tokens), so we keep two offsets, as vLLM does: text is decoded
    from ``prefix_offset`` and only the part after ``read_offset`` is new; a piece that
    ends in U+FFFD (an incomplete character) is held back until the next token.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        tok = self.tokenizer
        skip = self.skip_special_tokens
        prefix = tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += piece
            return piece
        return ""
