"""Sampling parameters of one request (the names follow vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. Otherwise the logits are divided by the
    temperature, restricted to the ``top_k`` most likely tokens (``-1``: all) and to the
    smallest set whose probability reaches ``top_p``, and one token is drawn (from a
    per-request generator when ``seed`` is given, so the draw is reproducible).
    Generation stops at EOS (unless ``ignore_eos``), after ``max_tokens`` tokens, or
    when the text produced so far contains one of ``stop`` (the stop string itself is
    left out of the text).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value, expected: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {name}={value!r}: {expected}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", self.top_k, "must be -1 (disabled) or >= 1")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
