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


# The prompt's last tokens that may prime the detokenizer: the shortest suffix of this many
# tokens whose text is complete (vLLM v0.11.0 tries 4 to 23, vllm/v1/engine/detokenizer.py,
# FastIncrementalDetokenizer).
PROMPT_CONTEXT_TOKENS = range(4, 24)


def prompt_context(tokenizer, prompt_ids, skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last few token ids, to decode an output as it continues the prompt.

    A SentencePiece tokenizer (Llama-2, Mistral) drops the leading space of the first word of
    whatever it decodes: ``decode(["▁world"])`` is ``"world"``, while after ``"hello"`` the
    output reads ``" world"``. Decoding ``context + output`` and cutting ``decode(context)``
    off gives the latter (:func:`decode_output`). As in vLLM the context is the shortest
    suffix of 4 to 23 tokens (the whole prompt if shorter) that decodes without U+FFFD; none
    when no such suffix exists (a prompt ending inside a character), and then the output is
    decoded on its own.
    """
    ids = list(prompt_ids)
    lo, hi = min(PROMPT_CONTEXT_TOKENS.start, len(ids)), min(PROMPT_CONTEXT_TOKENS.stop - 1, len(ids))
    for n in range(max(lo, 1), hi + 1):
        tail = ids[-n:]
        if "\ufffd" not in tokenizer.decode(tail, skip_special_tokens=skip_special_tokens):
            return tail
    return []


def decode_output(tokenizer, output_ids, context=(), skip_special_tokens: bool = True) -> str:
    """``decode(context + output_ids)`` less ``decode(context)``: the output's text after the
    prompt's ``context`` (:func:`prompt_context`); a plain ``decode(output_ids)`` when the two
    decodes do not line up (a tokenizer that rewrites text across the boundary)."""
    context = list(context)
    if context:
        prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(context + list(output_ids), skip_special_tokens=skip_special_tokens)
        if full.startswith(prefix):
            return full[len(prefix):]
    return tokenizer.decode(list(output_ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, one call per new token.

    Decoding token by token breaks multi-byte characters (a Chinese character can span
    several byte-level tokens), so we keep two offsets, as vLLM does: text is decoded
    from ``prefix_offset`` and only the part after ``read_offset`` is new; a piece that
    ends in U+FFFD (an incomplete character) is held back until the next token.

    ``prompt_ids``: the request's prompt; its last few tokens (:func:`prompt_context`) prime
    the offsets, so that the first output token is decoded in context (a SentencePiece
    tokenizer would otherwise drop its leading space). They are not part of ``text``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids=()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = prompt_context(tokenizer, prompt_ids, skip_special_tokens) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
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
