"""What the HTTP router reads of a request to route it: :class:`RoutedRequest`.

A router class (``minibatch.routing.routers``) reads a request's ``prompt_len``,
``max_tokens``, ``model``, ``tenant`` and, for ``prefix_aware`` and ``kv_aware``, its
``prompt_token_ids``.

- A prompt of token ids is used as is.
- A text prompt, for the two cache-aware policies, is tokenized with the upstream model's
  tokenizer when the router can load it without a download (the embedded ``tiny`` model, a
  local checkpoint directory, or ``--tokenizer PATH``; :class:`Tokens`); otherwise its UTF-8
  bytes stand in for tokens (prefix matches then count bytes, which still finds shared
  prefixes, only on another scale). Only the first ``--routing-prefix-chars`` characters are
  tokenized (default :data:`DEFAULT_ROUTING_PREFIX_CHARS`, a few thousand tokens: enough to
  tell apart the shared prefixes that matter, a system prompt or the turns of a
  conversation), in a thread of the router's own, so that a prompt of megabytes neither
  blocks the event loop nor costs more than that prefix; the rest of the prompt counts
  toward ``prompt_len`` at the prefix's characters per token. ``prompt_token_ids`` is then the
  prefix's tokens, so a prefix match is measured against the prefix.
- A chat request's "prompt" for routing is its messages as ``role: content`` lines: the
  upstream's chat template is not known here, and the same conversation always gives the
  same text.
- Other policies need only a length: the UTF-8 byte count of a text prompt (no tokenizing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROUTING_PREFIX_CHARS = 16384


@dataclass
class RoutedRequest:
    """What a router class reads of a request (the attributes of ``RequestSpec`` it uses)."""

    prompt_len: int
    max_tokens: int
    prompt_token_ids: list[int] | None
    model: str
    tenant: str | None = None
    request_id: str | None = None


class Tokens:
    """Prompt token ids for routing: a tokenizer the router can load locally, or UTF-8 bytes."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, name: str | None) -> Tokens:
        """The tokenizer of ``name`` if it is ``tiny`` or a local directory, else bytes."""
        if not name:
            return cls(None)
        from minibatch.model.loader import TINY_NAMES, tiny_model_path
        from minibatch.tokenizer import load_tokenizer

        path = tiny_model_path() if name in TINY_NAMES else Path(name).expanduser()
        try:
            return cls(load_tokenizer(path) if path.is_dir() else None)
        except (OSError, ValueError):
            return cls(None)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8", "replace"))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def detokenizer(self, prompt_ids=(), skip_special_tokens: bool = True):
        if self.tokenizer is None:
            return None
        from minibatch.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens, prompt_ids)


class RoutingPrompts:
    """Builds :class:`RoutedRequest` s; tokenizes (a bounded prefix) in a thread of its own."""

    def __init__(self, needs_tokens: bool, prefix_chars: int = DEFAULT_ROUTING_PREFIX_CHARS):
        if prefix_chars < 1:
            raise ValueError("--routing-prefix-chars must be at least 1")
        self.needs_tokens = needs_tokens
        self.prefix_chars = prefix_chars
        self.tokens: Tokens | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def text_of(body: dict, chat: bool):
        """The request's prompt: token ids (a list), or text."""
        prompt = body.get("messages") if chat else body.get("prompt")
        if not chat and isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)
        if chat and isinstance(prompt, list):
            return "".join(f"{m.get('role')}: {m.get('content')}\n" for m in prompt if isinstance(m, dict))
        return prompt if isinstance(prompt, str) else json.dumps(prompt)

    def prefix_ids(self, text: str) -> tuple[list[int], int]:
        """The token ids of ``text``'s first ``prefix_chars`` characters, and the whole text's
        estimated token count (the rest at the prefix's characters per token)."""
        head = text[:self.prefix_chars]
        ids = (self.tokens or Tokens()).encode(head)
        if len(head) == len(text) or not head:
            return ids, len(ids)
        return ids, round(len(ids) * len(text) / len(head))

    async def routed(self, body: dict, chat: bool) -> RoutedRequest:
        prompt = self.text_of(body, chat)
        ids: list[int] | None = None
        if isinstance(prompt, list):
            ids, length = prompt, len(prompt)
        elif self.needs_tokens:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minibatch-router-tokens")
            ids, length = await asyncio.get_running_loop().run_in_executor(self._pool, self.prefix_ids, prompt)
        else:
            length = len(prompt.encode("utf-8", "replace"))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        user = body.get("user")
        return RoutedRequest(prompt_len=max(length, 1), max_tokens=max_tokens if isinstance(max_tokens, int) else 16,
                             prompt_token_ids=ids if self.needs_tokens else None, model=body["model"],
                             tenant=user if isinstance(user, str) else None)
