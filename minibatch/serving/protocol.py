"""The OpenAI HTTP API, the subset ``minibatch serve`` speaks: request checks and response shapes.

Requests are plain JSON objects, checked field by field so that every mistake gets a
400 whose message names the field (as OpenAI and vLLM do), in the error shape
``{"error": {"message", "type", "param", "code"}}``. Supported: ``/v1/completions`` and
``/v1/chat/completions`` with ``n=1``, ``prompt`` (a string, a list of token ids, or a
one-element list of either), ``messages``, ``max_tokens`` (``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``, ``seed``,
``ignore_eos`` (vLLM extensions), ``stream`` and ``stream_options.include_usage``.

Chat prompts use the tokenizer's chat template when it has one (the tiny model's is
ChatML). Without one, :data:`PLAIN_CHAT_TEMPLATE` applies: one ``"{role}: {content}"``
line per message, then ``"assistant:"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minibatch.sampling_params import SamplingParams

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"   # per message; the prompt ends with "assistant:"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Options that would change the answer but are not implemented: refuse rather than ignore.
UNSUPPORTED = {"echo": False, "suffix": None, "logprobs": None, "top_logprobs": None,
               "tools": None, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0,
               "repetition_penalty": 1, "logit_bias": None}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else str(self.status)}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class GenerationRequest:
    """A checked request: what to generate, how, and how to answer."""

    chat: bool
    model: str | None
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


# -- field checks -----------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typed(body: dict, name: str, check, expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(name, f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}")
    return value


def _token_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _token_ids(p[0])):
        p = p[0]                                    # a batch of one
    if isinstance(p, str):
        if p == "":
            raise bad("prompt", "'prompt' is empty: a request needs at least one token")
        return p
    if _token_ids(p):
        if not p:
            raise bad("prompt", "'prompt' is empty: a request needs at least one token")
        return p
    if isinstance(p, list) and all(isinstance(x, str) or _token_ids(x) for x in p):
        raise bad("prompt", f"'prompt' holds {len(p)} prompts; this server takes one per request")
    raise bad("prompt", "'prompt' must be a string, a list of token ids, or a one-element list of either")


def _text_content(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad("messages", f"messages[{i}].content: only text parts "
                                      "({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad("messages", f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad("messages", f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        out.append({"role": role, "content": _text_content(m.get("content"), i)})
    return out


def render_chat(messages: list[dict], tokenizer) -> str:
    """The prompt text for a conversation, ready for the assistant's turn."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may refuse a conversation (e.g. role order)
            raise bad("messages", f"the chat template rejected these messages: {e}") from None
    return "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages) + "assistant:"


def parse_request(body, chat: bool, tokenizer, default_max_tokens: int) -> GenerationRequest:
    """Check a completions (``chat=False``) or chat completions request body."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (None, default):
            raise bad(name, f"'{name}' is not supported by this server")
    n = _typed(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad("n", f"'n' must be 1 (this server returns one choice per request), got {n}")
    model = _typed(body, "model", lambda v: isinstance(v, str), "a string")
    prompt = render_chat(_messages(body), tokenizer) if chat else _prompt(body)
    max_tokens = _typed(body, "max_tokens", _is_int, "an integer")
    if chat and max_tokens is None:
        max_tokens = _typed(body, "max_completion_tokens", _is_int, "an integer")
    if max_tokens is None:
        # OpenAI's completions default is 16; chat runs to the end of the context (as vLLM).
        max_tokens = default_max_tokens if chat else 16
    if max_tokens <= 0:
        raise bad("max_tokens", f"'max_tokens' must be at least 1, got {max_tokens}")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise bad("stop", "'stop' must be a string or a list of strings")
    stream_options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    kw = dict(
        temperature=_typed(body, "temperature", _is_number, "a number", 1.0),
        top_p=_typed(body, "top_p", _is_number, "a number", 1.0),
        top_k=_typed(body, "top_k", _is_int, "an integer", -1),
        seed=_typed(body, "seed", _is_int, "an integer"),
        ignore_eos=_typed(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False),
        stop_token_ids=_typed(body, "stop_token_ids", _token_ids, "a list of token ids", []),
        max_tokens=max_tokens, stop=stop)
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        name = next((k for k in kw if f" {k}=" in str(e)), None)
        raise bad(name, str(e)) from None
    return GenerationRequest(
        chat=chat, model=model, prompt=prompt, params=params,
        stream=_typed(body, "stream", lambda v: isinstance(v, bool), "a boolean", False),
        include_usage=bool(_typed(stream_options, "include_usage", lambda v: isinstance(v, bool),
                                  "a boolean", False)))


# -- responses ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str | None,
             stop_reason, usage_: dict) -> dict:
    """The non-streaming answer (``text_completion`` or ``chat.completion``)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage_}


def chunk(rid: str, model: str, created: int, chat: bool, text: str | None,
          finish_reason: str | None = None, role: bool = False, usage_: dict | None = None) -> dict:
    """One streamed chunk; ``text=None`` makes the usage-only chunk (empty ``choices``)."""
    if text is None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
