"""The OpenAI HTTP API, the subset ``minibatch serve`` speaks: request checks and response shapes.

Requests are plain JSON objects, checked field by field so that every mistake gets a
4xx whose message names the field (as OpenAI and vLLM do), in the error shape
``{"error": {"message", "type", "param", "code"}}``. The sampling fields go through the
one validator the ``LLM`` API uses too (:func:`minibatch.sampling_params.validate_sampling`:
type, range, finiteness). Supported: ``/v1/completions`` and ``/v1/chat/completions``
with ``n=1``, ``prompt`` (a string, a list of token ids, or a one-element list of either),
``messages``, ``max_tokens`` (``max_completion_tokens``), ``temperature``, ``top_p``,
``top_k``, ``stop``, ``stop_token_ids``, ``seed``, ``ignore_eos`` (vLLM extensions),
``stream``, ``stream_options.include_usage`` and vLLM's ``return_token_ids`` (vLLM >= 0.10.2,
``vllm/entrypoints/openai/protocol.py``: each choice then carries ``token_ids``, the
generated ids, in a stream those of that chunk, and ``prompt_token_ids``, in a stream only in
the first chunk; the HTTP router resumes a cut stream from them).

What OpenAI clients send by default is accepted (``logprobs: false``, ``tools: []``,
``tool_choice: "none"``, ``response_format: {"type": "text"}``, zero penalties, ...).
Any other value of an option that would change the answer but is not implemented
(:data:`UNSUPPORTED`: logprobs, tools, JSON output modes, penalties, ...) is refused
with a 400 naming it, never silently ignored. Fields the API defines as metadata
(``user``, ``metadata``, ...) are ignored.

Chat prompts use the tokenizer's chat template when it has one (the tiny model's is
ChatML). Without one, :data:`PLAIN_CHAT_TEMPLATE` applies: one ``"{role}: {content}"``
line per message, then ``"assistant:"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minibatch.sampling_params import InvalidParameter, SamplingParams, is_int, show

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"   # per message; the prompt ends with "assistant:"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Options that would change the answer but are not implemented: each one's accepted values
# (what clients send to mean "off"); anything else is refused rather than ignored.
UNSUPPORTED = {
    "echo": (False,), "suffix": ("",), "logprobs": (False,), "top_logprobs": (0,), "best_of": (1,),
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "min_p": (0,), "min_tokens": (0,), "prompt_logprobs": (), "use_beam_search": (False,),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "modalities": (["text"],), "audio": (), "prediction": (),
}
WHY_UNSUPPORTED = {
    "response_format": "this server does not constrain its output to JSON; only {'type': 'text'} is accepted",
    "tools": "this server does not call tools; only an empty list is accepted",
    "tool_choice": "this server does not call tools; only 'none' (or 'auto' without tools) is accepted",
    "logprobs": "this server does not return log probabilities",
    "top_logprobs": "this server does not return log probabilities",
}


class APIError(Exception):
    """An error answered in OpenAI's shape (``headers``: extra response headers)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else str(self.status)}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class GenerationRequest:
    """A checked request: what to generate, how, and how to answer."""

    chat: bool
    model: str | None
    prompt: str | list[int]            # text, token ids, or (chat) the rendered conversation
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None
    return_token_ids: bool = False     # vLLM's extension (>= 0.10.2): token ids beside the text


# -- field checks -----------------------------------------------------------------------
def _same(value, accepted) -> bool:
    """``value == accepted`` without Python's ``False == 0 == 0.0`` (types must agree,
    but an int and a float of the same value are the same number)."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return isinstance(value, bool) and isinstance(accepted, bool) and value == accepted
    if isinstance(value, (int, float)) and isinstance(accepted, (int, float)):
        return value == accepted
    return type(value) is type(accepted) and value == accepted


def _typed(body: dict, name: str, check, expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(name, f"'{name}' must be {expected}, got {type(value).__name__} {show(value)}")
    return value


def _token_ids(v) -> bool:
    return isinstance(v, list) and all(is_int(t) for t in v)


def find_lone_surrogate(body) -> str | None:
    """The top-level field of the first string holding a lone UTF-16 surrogate (``"\\ud800"``
    is valid JSON but not text: it cannot be tokenized nor encoded as UTF-8), or None.
    Iterative, so a deeply nested body cannot exhaust the stack."""
    todo = [(None, body)]
    while todo:
        top, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return top or "(body)"
        elif isinstance(v, dict):
            for k, x in v.items():
                todo.append((top or k, k))
                todo.append((top or k, x))
        elif isinstance(v, list):
            todo.extend((top, x) for x in v)
    return None


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
            raise bad("messages", f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {show(role)}")
        if m.get("tool_calls"):
            raise bad("messages", f"messages[{i}].tool_calls: this server does not call tools")
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


def _check_unsupported(body: dict) -> None:
    for name, accepted in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or any(_same(value, a) for a in accepted):
            continue
        if name == "tool_choice" and body.get("tools"):
            continue                                      # reported as 'tools'
        why = WHY_UNSUPPORTED.get(name, "this option is not implemented by this server")
        what = f"'{name}'={show(value)}"
        if name == "response_format" and isinstance(value, dict) and "type" in value:
            what = f"'response_format' type {show(value['type'])}"
        raise bad(name, f"{what} is not supported: {why}")


def parse_request(body, chat: bool, tokenizer=None, default_max_tokens: int = 16,
                  render: bool = True) -> GenerationRequest:
    """Check a completions (``chat=False``) or chat completions request body.

    ``render``: render a chat's messages into ``prompt`` here (``False`` leaves ``prompt``
    empty and the checked ``messages`` for the caller, e.g. to check their size first)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _check_unsupported(body)
    n = _typed(body, "n", is_int, "an integer", 1)
    if n != 1:
        raise bad("n", f"'n' must be 1 (this server returns one choice per request), got {show(n)}")
    model = _typed(body, "model", lambda v: isinstance(v, str), "a string")
    messages = _messages(body) if chat else None
    prompt = (render_chat(messages, tokenizer) if render else "") if chat else _prompt(body)
    max_name = "max_tokens"
    max_tokens = body.get("max_tokens")
    if chat and max_tokens is None and body.get("max_completion_tokens") is not None:
        max_name, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is None:
        # OpenAI's completions default is 16; chat runs to the end of the context (as vLLM).
        max_tokens = default_max_tokens if chat else 16
    stream_options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})

    def given(name, default):
        value = body.get(name)
        return default if value is None else value

    kw = dict(temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", -1),
              seed=body.get("seed"), ignore_eos=given("ignore_eos", False),
              stop_token_ids=given("stop_token_ids", []), max_tokens=max_tokens, stop=body.get("stop"))
    try:
        params = SamplingParams(**kw)
    except InvalidParameter as e:
        name = max_name if e.param == "max_tokens" else e.param
        raise bad(name, str(e).replace("max_tokens", name)) from None
    return GenerationRequest(
        chat=chat, model=model, prompt=prompt, params=params,
        stream=_typed(body, "stream", lambda v: isinstance(v, bool), "a boolean", False),
        include_usage=bool(_typed(stream_options, "include_usage", lambda v: isinstance(v, bool),
                                  "a boolean", False)),
        messages=messages,
        return_token_ids=bool(_typed(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean", False)))


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """A number of characters above which a text prompt certainly has ``>= max_model_len``
    tokens, so that it can be refused without tokenizing it (``None``: no such bound known).

    One token covers at most ``L`` characters, ``L`` the longest vocabulary entry or added
    token (a byte-level entry's length counts bytes, at least its characters). A
    normaliser may shrink text before the model sees it (Unicode composition merges at
    most a few code points into one), hence a factor 4 when the tokenizer has one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        longest = max(len(k) for k in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None
    factor = 1 if backend.normalizer is None else 4
    return max_model_len * max(longest, 1) * factor


# -- responses ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str | None,
             stop_reason, usage_: dict, token_ids: tuple[list[int], list[int]] | None = None) -> dict:
    """The non-streaming answer (``text_completion`` or ``chat.completion``); ``token_ids``:
    (prompt ids, generated ids) for ``return_token_ids``."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    if token_ids is not None:
        choice["prompt_token_ids"], choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage_}


def chunk(rid: str, model: str, created: int, chat: bool, text: str | None,
          finish_reason: str | None = None, role: bool = False, usage_: dict | None = None,
          token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """One streamed chunk; ``text=None`` makes the usage-only chunk (empty ``choices``);
    ``token_ids`` / ``prompt_token_ids`` are added to the choice when given (``return_token_ids``)."""
    if text is None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    if choices and prompt_token_ids is not None:
        choices[0]["prompt_token_ids"] = prompt_token_ids
    if choices and token_ids is not None:
        choices[0]["token_ids"] = token_ids
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
