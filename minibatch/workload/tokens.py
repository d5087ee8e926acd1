"""Deterministic synthetic prompt token ids.

Workloads describe prompts by length, and sometimes by what they share: a
``prefix_id`` group (the same system prompt) or Mooncake ``hash_ids`` (ids of
512-token blocks; equal ids at the same position mean equal content). An engine
needs real token ids, and prefix caching only shows up if shared content becomes
*identical* ids. This module turns those descriptions into ids.

Every id sequence is cut from a *stream*: an endless series of 512-token blocks,
each block drawn from its own random generator seeded by ``(seed, kind, key,
block index)``. So:

- the same (seed, vocabulary, key) always gives the same ids, on any machine;
- the first k ids of a stream do not depend on how many ids are asked for, so
  a prompt truncated to a shorter length still shares its prefix;
- different keys give unrelated ids (equal only by chance, 1/vocab per token).

Ids are uniform over ``[0, vocab_size)`` minus ``reserved_ids`` (pass the
tokenizer's special ids, or ``range(low)`` for ids in ``[low, vocab_size)``).
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

__all__ = ["BLOCK_TOKENS", "TokenSynth", "stable_key"]

BLOCK_TOKENS = 512   # Mooncake's hash block size; also our stream block size

# What a stream belongs to: its key lives in one of these namespaces.
REQUEST, PREFIX, HASH_BLOCK = 0, 1, 2


def stable_key(x) -> int:
    """A non-negative integer for a stream key, the same in every process
    (Python's ``hash`` of a str is salted per process, so it is not used)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0:
        return int(x)
    digest = hashlib.blake2b(repr(x).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | (1 << 64)  # never equal to a plain int key


class TokenSynth:
    """Makes token-id streams for one (vocab_size, seed, reserved_ids)."""

    def __init__(self, vocab_size: int, seed: int = 0, reserved_ids: Iterable[int] = ()):
        if int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        reserved = np.fromiter((int(r) for r in reserved_ids), dtype=np.int64)
        allowed = np.setdiff1d(np.arange(int(vocab_size), dtype=np.int64), reserved)
        if allowed.size == 0:
            raise ValueError("every id in the vocabulary is reserved")
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self._allowed = allowed.astype(np.int32)
        self._cache: dict[tuple[int, int, int], np.ndarray] = {}

    def block(self, kind: int, key: int, index: int, cache: bool = False) -> np.ndarray:
        """Block ``index`` (512 ids) of the stream ``(kind, key)``."""
        k = (kind, key, index)
        out = self._cache.get(k)
        if out is None:
            rng = np.random.default_rng([self.seed, kind, key, index])
            out = self._allowed[rng.integers(0, self._allowed.size, BLOCK_TOKENS)]
            if cache:
                self._cache[k] = out
        return out

    def stream(self, kind: int, key: int, length: int, cache: bool = False) -> np.ndarray:
        """The first ``length`` ids of the stream ``(kind, key)``."""
        nblocks = -(-length // BLOCK_TOKENS)
        if nblocks == 0:
            return np.empty(0, dtype=np.int32)
        parts = [self.block(kind, key, i, cache) for i in range(nblocks)]
        return np.concatenate(parts)[:length]

    def prompt(self, prompt_len: int, request_key, prefix_id=None, prefix_len: int = 0,
               hash_ids=None) -> list[int]:
        """Token ids of one prompt.

        - with ``hash_ids``: block i is the block named ``hash_ids[i]`` (the last one
          cut to fit ``prompt_len``); tokens past the last block are the request's own;
        - with ``prefix_id``: the first ``prefix_len`` ids are the group's, the rest
          the request's own;
        - otherwise all ids are the request's own (keyed by ``request_key``).
        """
        parts, n = [], 0
        if hash_ids:
            for h in hash_ids:
                if n >= prompt_len:
                    break
                blk = self.block(HASH_BLOCK, stable_key(h), 0, cache=True)[: prompt_len - n]
                parts.append(blk)
                n += blk.size
        elif prefix_id is not None and prefix_len > 0:
            n = min(prefix_len, prompt_len)
            parts.append(self.stream(PREFIX, stable_key(prefix_id), n, cache=True))
        if n < prompt_len:
            parts.append(self.stream(REQUEST, stable_key(request_key), prompt_len - n))
        return np.concatenate(parts).tolist() if parts else []
