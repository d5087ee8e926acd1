"""The OpenAI HTTP API, the subset ``minibatch serve`` speaks: request checks and response shapes.

Requests are plain JSON objects, checked field by field so that every mistake gets a
4xx whose message names the field (as OpenAI and vLLM do), in the error shape
``{"error": {"message", "type", "param", "code"}}``. The sampling fields go through the
one validator the ``LLM`` API uses too (:func:`minibatch.sampling_params.validate_sampling`:
type, range, finiteness).

Every field a request may carry is in one of four lists, and a field in none of them is
refused with a 400 naming it (as OpenAI does), so that nothing is silently ignored:

- implemented (:data:`COMMON_FIELDS`, :data:`COMPLETION_FIELDS`, :data:`CHAT_FIELDS`):
  ``/v1/completions`` with ``prompt`` (a string, a list of strings, a list of token ids,
  or a list of token-id lists: one set of choices per prompt), ``echo``, ``logprobs``
  (integer top-N); ``/v1/chat/completions`` with ``messages``, ``max_completion_tokens``,
  ``logprobs`` (bool) and ``top_logprobs``; both with ``n`` (independent samples; with a
  ``seed``, choice ``i`` uses ``seed + i`` as vLLM's parallel sampling does), ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, and vLLM's extensions
  ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``,
  ``skip_special_tokens``, ``add_special_tokens``, ``stream`` and ``stream_options``
  (``include_usage``, ``continuous_usage_stats``);
- metadata, accepted and ignored because it cannot change the answer (:data:`METADATA_FIELDS`:
  ``user``, ``metadata``, ``store``, ...);
- not implemented (:data:`UNSUPPORTED`: penalties, ``logit_bias``, ``suffix``, ``best_of`` > 1,
  prompt log probabilities, tools, JSON output modes, ...): the value clients send to mean
  "off" is accepted (``logprobs: false``, ``tools: []``, ``response_format: {"type": "text"}``,
  zero penalties, ...); any other value gets a 400 naming the field.

The limits follow vLLM's OpenAI server (``vllm/entrypoints/openai/protocol.py`` and
``serving_engine.py``, v0.11.0): ``n > 1`` needs sampling (``temperature > 0``), ``top_logprobs``
needs ``logprobs: true``, ``stream_options`` needs ``stream: true``, ``echo`` cannot be combined
with ``logprobs`` here (that needs the prompt's log probabilities, not implemented), and a
prompt plus ``max_tokens`` beyond ``max_model_len`` is refused with vLLM's message instead of
being cut short (without ``max_tokens`` a chat runs to the end of the context, as in vLLM).

Log probabilities are those of the model's raw distribution (``log_softmax`` of the logits,
before temperature and any mask: vLLM's default ``logprobs_mode="raw_logprobs"``), floored at
-9999.0 as vLLM does so that JSON never sees ``-inf``; token strings are ``decode([id])``.

Chat prompts use the tokenizer's chat template when it has one (the tiny model's is
ChatML). Without one, :data:`PLAIN_CHAT_TEMPLATE` applies: one ``"{role}: {content}"``
line per message, then ``"assistant:"``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from minibatch.sampling_params import (
    MAX_LOGPROBS,
    SEED_END,
    SEED_MIN,
    InvalidParameter,
    SamplingParams,
    is_int,
    show,
)

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"   # per message; the prompt ends with "assistant:"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
LOGPROB_FLOOR = -9999.0        # vLLM's floor for -inf (serving_completion.py, serving_chat.py)
MAX_CHOICES = 128              # prompts x n of one request: each is an engine request
# The fields each endpoint implements.
COMMON_FIELDS = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                 "skip_special_tokens", "add_special_tokens", "stream", "stream_options", "logprobs",
                 "return_token_ids"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# Fields that cannot change the answer: accepted and ignored.
METADATA_FIELDS = {"user", "metadata", "store", "service_tier", "request_id", "parallel_tool_calls",
                   "safety_identifier", "prompt_cache_key"}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
# Options that would change the answer but are not implemented: each one's accepted values
# (what clients send to mean "off"); anything else is refused rather than ignored.
UNSUPPORTED = {
    "suffix": ("",), "best_of": (1,),
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "prompt_logprobs": (), "use_beam_search": (False,), "length_penalty": (1,), "bad_words": ([],),
    "allowed_token_ids": (), "truncate_prompt_tokens": (), "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,), "priority": (0,),
    "logits_processors": (), "vllm_xargs": (), "cache_salt": (), "kv_transfer_params": (),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "structured_outputs": (), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "web_search_options": (), "verbosity": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (), "mm_processor_kwargs": (), "prompt_embeds": (),
}
WHY_UNSUPPORTED = {
    "response_format": "this server does not constrain its output to JSON; only {'type': 'text'} is accepted",
    "tools": "this server does not call tools; only an empty list is accepted",
    "tool_choice": "this server does not call tools; only 'none' (or 'auto' without tools) is accepted",
    "prompt_logprobs": "this server does not return the prompt's log probabilities",
    "best_of": "only best_of=1 is accepted (vLLM V1 does not support best_of either)",
    "suffix": "this server does not insert text after a completion",
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


def add_error_handlers(app, what: str) -> None:
    """Answer every error of a FastAPI ``app`` in OpenAI's shape: an :class:`APIError` as
    itself, an HTTP error (404, 405, ...) with its status, anything else as a 500 naming
    ``what`` failed ("server", "router"). Shared by the server and the HTTP router."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        err = APIError(500, f"internal {what} error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


@dataclass
class GenerationRequest:
    """A checked request: what to generate, how, and how to answer.

    ``prompt`` is the first (usually the only) prompt; ``prompts`` all of them (a
    completions request may carry several: ``n`` choices each, choice index
    ``prompt_index * n + i`` as in vLLM)."""

    chat: bool
    model: str | None
    prompt: str | list[int]            # text, token ids, or (chat) the rendered conversation
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None
    prompts: list | None = None        # None: [prompt]
    n: int = 1
    echo: bool = False
    logprobs: int | None = None        # top-N per token (completions ``logprobs``, chat ``top_logprobs``)
    continuous_usage: bool = False     # stream_options.continuous_usage_stats
    max_tokens_param: str | None = "max_tokens"   # the field that set max_tokens (None: defaulted)
    add_special_tokens: bool = False
    prompt_texts: list | None = None   # each prompt's text, for echo
    # vLLM's extension (>= 0.10.2, ``vllm/entrypoints/openai/protocol.py``): each choice also
    # carries ``token_ids``, the generated ids (in a stream, those of that chunk), and
    # ``prompt_token_ids`` (in a stream, only in its first chunk); the HTTP router resumes a cut
    # stream from them.
    return_token_ids: bool = False

    def all_prompts(self) -> list:
        return [self.prompt] if self.prompts is None else self.prompts

    def choice_params(self, i: int) -> SamplingParams:
        """Choice ``i``'s sampling parameters: a seeded request's choices use ``seed + i``
        (vLLM's ``ParentRequest.get_child_sampling_params``, v1/engine/parallel_sampling.py)."""
        if i == 0 or self.params.seed is None:
            return self.params
        seed = self.params.seed + i
        seed = seed if seed < SEED_END else seed - (SEED_END - SEED_MIN)   # stay in the seed range
        return dataclasses.replace(self.params, seed=seed)


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


def _prompts(body: dict) -> list:
    """The prompts of a completions request: ``prompt`` is a string, a list of token ids,
    a list of strings or a list of token-id lists (vLLM's ``CompletionRequest.prompt``)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required")
    p = body["prompt"]
    if isinstance(p, str) or _token_ids(p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _token_ids(x) for x in p):
        prompts = p
    else:
        raise bad("prompt", "'prompt' must be a string, a list of token ids, or a non-empty list of either")
    for k, x in enumerate(prompts):
        if len(x) == 0:
            where = "'prompt'" if len(prompts) == 1 else f"prompt[{k}]"
            raise bad("prompt", f"{where} is empty: a request needs at least one token")
    return prompts


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


def render_chat(messages: list[dict], tokenizer, add_generation_prompt: bool = True) -> str:
    """The prompt text for a conversation, ready for the assistant's turn (or, without
    ``add_generation_prompt``, ending after the last message)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template may refuse a conversation (e.g. role order)
            raise bad("messages", f"the chat template rejected these messages: {e}") from None
    text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages)
    return text + "assistant:" if add_generation_prompt else text


def _check_fields(body: dict, chat: bool) -> None:
    """Refuse unknown fields and the values of :data:`UNSUPPORTED` options that are not "off"."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name in known or name in METADATA_FIELDS or name in UNSUPPORTED:
            continue
        if chat and name == "echo":                       # vLLM's chat echo: not implemented
            if value is None or value is False:
                continue
            raise bad(name, f"'echo'={show(value)} is not supported for chat completions")
        other = "/v1/completions" if chat else "/v1/chat/completions"
        where = f" (it is a field of {other})" if name in (COMPLETION_FIELDS if chat else CHAT_FIELDS) else ""
        raise bad(name, f"unrecognized request field {show(name)}{where}: this server does not implement it")
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


def _logprobs(body: dict, chat: bool) -> int | None:
    """The number of top log probabilities per token, or ``None`` for none."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise bad("logprobs", f"'logprobs' must be a boolean, got {show(value)}")
        top = body.get("top_logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
            raise bad("top_logprobs", f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {show(top)}")
        if top and not value:     # vLLM's message (protocol.py, ChatCompletionRequest.check_logprobs)
            raise bad("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
        return (top or 0) if value else None
    if value is None or value is False:              # false: what some clients send to mean "off"
        return None
    if not is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise bad("logprobs", f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}] (the number of top "
                              f"log probabilities per token), got {show(value)}")
    return value


def parse_request(body, chat: bool, tokenizer=None, default_max_tokens: int = 16,
                  render: bool = True) -> GenerationRequest:
    """Check a completions (``chat=False``) or chat completions request body.

    ``default_max_tokens``: a chat's ``max_tokens`` when the request has none (the server
    then sets the rest of the context, once the prompt is tokenized; ``max_tokens_param``
    is ``None`` to say so). ``render``: render a chat's messages into ``prompt`` here
    (``False`` leaves ``prompt`` empty and the checked ``messages`` for the caller, e.g.
    to check their size first)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _check_fields(body, chat)
    n = _typed(body, "n", is_int, "an integer", 1)
    if n < 1:
        raise bad("n", f"'n' must be at least 1, got {show(n)}")
    model = _typed(body, "model", lambda v: isinstance(v, str), "a string")
    messages = _messages(body) if chat else None
    prompts = None if chat else _prompts(body)
    prompt = (render_chat(messages, tokenizer) if render else "") if chat else prompts[0]
    if n * (1 if chat else len(prompts)) > MAX_CHOICES:
        raise bad("n", f"{n} choices for each of {len(prompts or [0])} prompt(s) is more than this server's "
                       f"limit of {MAX_CHOICES} choices per request")
    max_name = "max_tokens"
    max_tokens = body.get("max_tokens")
    if chat and max_tokens is None and body.get("max_completion_tokens") is not None:
        max_name, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is None:
        # OpenAI's completions default is 16; chat runs to the end of the context (as vLLM).
        if chat:
            max_name, max_tokens = None, default_max_tokens
        else:
            max_tokens = 16
    stream = _typed(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    stream_options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    for key in stream_options:
        if key not in STREAM_OPTIONS:
            raise bad("stream_options", f"unrecognized stream option {show(key)}; known: {sorted(STREAM_OPTIONS)}")
    include_usage = _typed(stream_options, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    continuous = _typed(stream_options, "continuous_usage_stats", lambda v: isinstance(v, bool), "a boolean",
                        False)
    if stream_options and not stream:   # vLLM's message (protocol.py, validate_stream_options)
        raise bad("stream_options", "Stream options can only be defined when `stream=True`.")
    logprobs = _logprobs(body, chat)
    echo = False if chat else _typed(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
    if echo and logprobs is not None:
        raise bad("echo", "'echo' with 'logprobs' is not supported: it needs the prompt's log probabilities, "
                          "which this server does not compute")
    add_special = _typed(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", False)

    def given(name, default):
        value = body.get(name)
        return default if value is None else value

    kw = {"temperature": given("temperature", 1.0), "top_p": given("top_p", 1.0), "top_k": given("top_k", -1),
              "seed": body.get("seed"), "ignore_eos": given("ignore_eos", False),
              "stop_token_ids": given("stop_token_ids", []), "max_tokens": max_tokens, "stop": body.get("stop"),
              "min_p": given("min_p", 0.0), "min_tokens": given("min_tokens", 0), "logprobs": logprobs,
              "include_stop_str_in_output": given("include_stop_str_in_output", False),
              "skip_special_tokens": given("skip_special_tokens", True)}
    try:
        params = SamplingParams(**kw)
    except InvalidParameter as e:      # name the field the client set: max_tokens or max_completion_tokens
        name = (max_name or "max_tokens") if e.param == "max_tokens" else e.param
        raise bad(name, str(e).replace("max_tokens", max_name or "max_tokens")) from None
    if n > 1 and params.greedy:         # vLLM's message (sampling_params.py, _verify_greedy_sampling)
        raise bad("n", f"n must be 1 when using greedy sampling, got {n}.")
    return GenerationRequest(
        chat=chat, model=model, prompt=prompt, params=params, stream=stream, include_usage=include_usage,
        messages=messages, prompts=prompts, n=n, echo=echo, logprobs=logprobs, continuous_usage=continuous,
        max_tokens_param=max_name, add_special_tokens=add_special,
        return_token_ids=bool(_typed(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean", False)))


def check_context(req: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> None:
    """vLLM's context check (``serving_engine.py``, ``_validate_input``, v0.11.0): a prompt
    plus an explicit ``max_tokens`` beyond ``max_model_len`` is a 400, with vLLM's message.
    Without one (a chat), ``max_tokens`` becomes the rest of the context, as vLLM's
    ``get_max_tokens`` does."""
    if req.max_tokens_param is None:
        rest = max_model_len - num_prompt_tokens
        if req.params.max_tokens > rest:
            try:
                req.params = dataclasses.replace(req.params, max_tokens=rest)
            except InvalidParameter as e:      # min_tokens above what the context leaves
                raise bad(e.param, str(e)) from None
        return
    max_tokens = req.params.max_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad(req.max_tokens_param,
                  f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                  f"context length is {max_model_len} tokens and your request has {num_prompt_tokens} input "
                  f"tokens ({max_tokens} > {max_model_len} - {num_prompt_tokens}).")


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


def _floor(lp: float) -> float:
    return max(lp, LOGPROB_FLOOR)


def completion_logprobs(token_ids: list[int], entries: list, top_n: int, decode, text_offset: int = 0) -> dict:
    """The completions API's ``logprobs`` object for these tokens, as vLLM builds it
    (``serving_completion.py``, ``_create_completion_logprobs``, v0.11.0): per token its
    string, its log probability, a ``{token: logprob}`` map of the sampled token and the
    ``top_n`` most likely (so ``top_n`` or ``top_n + 1`` entries), and its offset in the text
    (the sum of the previous token strings' lengths, from ``text_offset``)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for tid, (lp, top) in zip(token_ids, entries):
        tok = decode(tid)
        tokens.append(tok)
        token_logprobs.append(_floor(lp))
        tops = {tok: _floor(lp)}
        for t, tlp in top[:top_n]:
            tops[decode(t)] = _floor(tlp)
        top_logprobs.append(tops)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list, top_n: int, decode) -> dict:
    """The chat API's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    ``top_logprobs`` the ``top_n`` most likely tokens, most likely first (OpenAI's definition;
    vLLM's shape, ``serving_chat.py``, ``_create_chat_logprobs``, v0.11.0)."""
    def entry(tid: int, lp: float) -> dict:
        tok = decode(tid)
        return {"token": tok, "logprob": _floor(lp), "bytes": list(tok.encode("utf-8", errors="replace"))}

    return {"content": [{**entry(tid, lp), "top_logprobs": [entry(t, tlp) for t, tlp in top[:top_n]]}
                        for tid, (lp, top) in zip(token_ids, entries)]}


@dataclass
class Choice:
    """One finished choice of a non-streaming answer."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: dict | None = None
    token_ids: tuple[list[int], list[int]] | None = None   # (prompt ids, generated ids): return_token_ids


def response(rid: str, model: str, chat: bool, text, finish_reason: str | None = None,
             stop_reason=None, usage_: dict | None = None, choices: list[Choice] | None = None) -> dict:
    """The non-streaming answer (``text_completion`` or ``chat.completion``): one choice of
    ``text`` or the list ``choices``."""
    if choices is None:
        choices = [Choice(0, text, finish_reason, stop_reason)]
    out = []
    for c in choices:
        if chat:
            out.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": c.logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": c.logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if c.token_ids is not None:
            out[-1]["prompt_token_ids"], out[-1]["token_ids"] = c.token_ids
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": out, "usage": usage_}


def chunk(rid: str, model: str, created: int, chat: bool, text: str | None,
          finish_reason: str | None = None, role: bool = False, usage_: dict | None = None,
          index: int = 0, logprobs: dict | None = None, stop_reason=None,
          token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """One streamed chunk; ``text=None`` makes the usage-only chunk (empty ``choices``);
    ``token_ids`` / ``prompt_token_ids`` are added to the choice when given (``return_token_ids``)."""
    if text is None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        choices = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    if choices and finish_reason is not None:
        choices[0]["stop_reason"] = stop_reason
    if choices and prompt_token_ids is not None:
        choices[0]["prompt_token_ids"] = prompt_token_ids
    if choices and token_ids is not None:
        choices[0]["token_ids"] = token_ids
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


# -- /tokenize and /detokenize (vLLM's shapes: protocol.py TokenizeCompletionRequest,
# TokenizeChatRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, v0.11.0) ------------
TOKENIZE_COMPLETION_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs",
                        "continue_final_message", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs"}


@dataclass
class TokenizeRequest:
    model: str | None
    text: str | None                   # a prompt's text (None: a chat, render ``messages``)
    messages: list[dict] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize(body) -> TokenizeRequest:
    """``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
    "add_generation_prompt": true, "add_special_tokens": false}``, plus ``return_token_strs``
    (vLLM's defaults)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    chat = "messages" in body
    if chat and "prompt" in body:
        raise bad("prompt", "give either 'prompt' or 'messages', not both")
    known = TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_COMPLETION_FIELDS
    for name in body:
        if name not in known:
            raise bad(name, f"unrecognized field {show(name)} for /tokenize")
    for name, off in (("continue_final_message", False), ("chat_template", None), ("tools", None),
                      ("chat_template_kwargs", None), ("mm_processor_kwargs", None)):
        if name in body and body[name] not in (None, off) and body[name] != {}:
            raise bad(name, f"'{name}'={show(body[name])} is not supported by this server")
    def flag(name: str, default: bool) -> bool:
        return _typed(body, name, lambda v: isinstance(v, bool), "a boolean", default)

    model = _typed(body, "model", lambda v: isinstance(v, str), "a string")
    if chat:
        return TokenizeRequest(model, None, _messages(body), flag("add_special_tokens", False),
                               flag("add_generation_prompt", True), flag("return_token_strs", False))
    text = body.get("prompt")
    if not isinstance(text, str):
        raise bad("prompt", "'prompt' is required and must be a string (or send 'messages')")
    return TokenizeRequest(model, text, None, flag("add_special_tokens", True), True,
                           flag("return_token_strs", False))


def parse_detokenize(body) -> tuple[str | None, list[int]]:
    """``{"tokens": [ids]}`` -> (model, ids)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name in body:
        if name not in ("model", "tokens"):
            raise bad(name, f"unrecognized field {show(name)} for /detokenize")
    tokens = body.get("tokens")
    if not _token_ids(tokens):
        raise bad("tokens", "'tokens' is required and must be a list of token ids")
    return _typed(body, "model", lambda v: isinstance(v, str), "a string"), tokens
