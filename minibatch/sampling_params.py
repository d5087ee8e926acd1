"""Sampling parameters of one request (the names follow vLLM's ``SamplingParams``), and the
one validator of their values, shared by the ``LLM`` API and the server's request parsing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A temperature below this is greedy decoding (vLLM's _SAMPLING_EPS): dividing logits by a
# vanishing temperature would overflow float32 to inf, and the softmax of inf is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes [-2**63, 2**64).
SEED_MIN, SEED_END = -(2 ** 63), 2 ** 64
# Every stop string is searched for after every token, and every stop token id compared:
# bounded, so that one request's list cannot slow every step of the batch down.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 256
# Top log probabilities a request may ask for per token (vLLM's default --max-logprobs is 20,
# vllm/config/model.py, v0.11.0; OpenAI's chat API allows 0..20 too).
MAX_LOGPROBS = 20


class InvalidParameter(ValueError):
    """A sampling or request field outside its domain. ``param`` names the field (the
    OpenAI API's name where it has one), so that the server can answer with ``param`` set."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def is_int(v) -> bool:
    """An integer, not a bool (JSON ``true`` is not ``1`` here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_finite(v) -> bool:
    """A finite number. NaN and +-inf fail (Python's JSON parser accepts ``NaN``, ``Infinity``
    and ``1e400``), and so does an integer too large for a float (a huge JSON integer)."""
    if not is_number(v):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def show(v) -> str:
    """A short, always printable rendering of a value for an error message."""
    if is_int(v) and abs(v) >= 10 ** 30:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(name: str, value, expected: str) -> InvalidParameter:
    return InvalidParameter(name, f"invalid sampling parameter {name}={show(value)}: {expected}")


def validate_sampling(temperature, top_p, top_k, max_tokens, ignore_eos, stop, seed, stop_token_ids,
                      min_p=0.0, min_tokens=0, logprobs=None, include_stop_str_in_output=False,
                      skip_special_tokens=True) -> None:
    """Raise :class:`InvalidParameter` naming the first field out of its domain.

    Every field is checked for its type, its range and (numbers) finiteness, so that a
    request that passes can never make the sampler fail: ``temperature`` a finite number
    >= 0 (below :data:`GREEDY_BELOW_TEMPERATURE` is greedy); ``top_p`` in (0, 1]; ``top_k``
    -1 (off) or an integer >= 1 (above the vocabulary size it keeps every token);
    ``max_tokens`` an integer >= 1; ``ignore_eos`` a bool; ``stop`` a list of at most
    :data:`MAX_STOP_STRINGS` non-empty strings; ``seed`` ``None`` or an integer in
    [-2**63, 2**64); ``stop_token_ids`` at most :data:`MAX_STOP_TOKEN_IDS` integers >= 0;
    ``min_p`` in [0, 1]; ``min_tokens`` an integer in [0, max_tokens]; ``logprobs`` ``None``
    or an integer in [0, :data:`MAX_LOGPROBS`]; ``include_stop_str_in_output`` and
    ``skip_special_tokens`` bools (vLLM's ranges, ``vllm/sampling_params.py`` v0.11.0).
    """
    if not is_finite(temperature) or temperature < 0:
        raise _bad("temperature", temperature, "must be a finite number >= 0 (0 means greedy)")
    if not is_finite(top_p) or not 0.0 < top_p <= 1.0:
        raise _bad("top_p", top_p, "must be a number in (0, 1]")
    if not is_int(top_k) or (top_k < 1 and top_k != -1):
        raise _bad("top_k", top_k, "must be -1 (disabled) or an integer >= 1")
    if not is_int(max_tokens) or max_tokens <= 0:
        raise _bad("max_tokens", max_tokens, "must be an integer >= 1")
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", ignore_eos, "must be a boolean")
    if not isinstance(stop, list) or any(not isinstance(s, str) or s == "" for s in stop):
        raise _bad("stop", stop, "must be a string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"<{len(stop)} strings>", f"at most {MAX_STOP_STRINGS} stop strings")
    if seed is not None and (not is_int(seed) or not SEED_MIN <= seed < SEED_END):
        raise _bad("seed", seed, "must be an integer in [-2**63, 2**64) or None")
    if not isinstance(stop_token_ids, list) or any(not is_int(t) or t < 0 for t in stop_token_ids):
        raise _bad("stop_token_ids", stop_token_ids, "must be a list of integers >= 0")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", f"<{len(stop_token_ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS} ids")
    if not is_finite(min_p) or not 0.0 <= min_p <= 1.0:
        raise _bad("min_p", min_p, "must be a number in [0, 1] (0 disables it)")
    if not is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise _bad("min_tokens", min_tokens, f"must be an integer in [0, max_tokens={max_tokens}]")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise _bad("logprobs", logprobs, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
    for name, value in (("include_stop_str_in_output", include_stop_str_in_output),
                        ("skip_special_tokens", skip_special_tokens)):
        if not isinstance(value, bool):
            raise _bad(name, value, "must be a boolean")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. Otherwise the logits are divided by the
    temperature, restricted to the ``top_k`` most likely tokens (``-1``: all) and to the
    smallest set whose probability reaches ``top_p``, and one token is drawn (from a
    per-request generator when ``seed`` is given, so the draw is reproducible).
    Generation stops at EOS (unless ``ignore_eos``), after ``max_tokens`` tokens, or
    when the text produced so far contains one of ``stop`` (the stop string itself is
    left out of the text unless ``include_stop_str_in_output``). The values allowed are
    those of :func:`validate_sampling`; a bad one raises :class:`InvalidParameter` (a
    ``ValueError``) naming it.

    vLLM's further options, with its meaning (``vllm/sampling_params.py`` and
    ``vllm/v1/sample/sampler.py``, v0.11.0): ``min_p`` drops tokens whose probability
    (after temperature) is below ``min_p`` times the most likely one's; ``min_tokens``
    masks EOS and ``stop_token_ids`` and ignores stop strings until that many tokens
    exist (greedy rows too); ``logprobs`` returns, per generated token, its log
    probability and the ``logprobs`` most likely tokens' ones, all from the model's raw
    distribution (``log_softmax`` of the logits before temperature or any mask, vLLM's
    default ``logprobs_mode="raw_logprobs"``); ``skip_special_tokens`` leaves special
    tokens out of the text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Check every field (:func:`validate_sampling`) and store the numbers as floats.
        The engine calls it again when a request is added, so a field changed after
        construction is checked too."""
        validate_sampling(self.temperature, self.top_p, self.top_k, self.max_tokens, self.ignore_eos,
                          self.stop, self.seed, self.stop_token_ids, self.min_p, self.min_tokens,
                          self.logprobs, self.include_stop_str_in_output, self.skip_special_tokens)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE
