"""The OpenAI API's request preparation and server-sent events, shared by ``minibatch serve``
(``server.py``), the HTTP router (``router.py``, ``relay.py``) and the Ray Serve ingress
(``minibatch.cluster.ray_backend``).

- :func:`load_body`: a request body as JSON, 400 if it is not JSON or holds text that is
  not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``);
- :func:`prepare_request`: parse, check (``protocol.py``), render a chat, tokenize, and check
  the context, refusing a prompt certainly too long by its characters before tokenizing it;
- :func:`sse_event` / :func:`sse_bytes`: one server-sent event of a JSON object, and
  :data:`SSE_DONE`, the stream's end.

The field-by-field checks and the response shapes are ``protocol.py``'s.
"""

from __future__ import annotations

import json

from minibatch.serving.protocol import (
    APIError,
    GenerationRequest,
    bad,
    check_context,
    find_lone_surrogate,
    parse_request,
    render_chat,
)

SSE_DONE = "data: [DONE]\n\n"


def load_body(raw: bytes):
    """The JSON body (400 if it is not JSON or holds text that is not valid Unicode)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(None, "the request body is nested too deeply to parse") from None
    except ValueError as e:        # not JSON, not UTF-8, or an integer of over 4300 digits
        raise bad(None, f"the request body is not valid JSON: {str(e)[:200]}") from None
    where = find_lone_surrogate(body)
    if where is not None:
        raise bad(where, f"'{where}' holds a lone UTF-16 surrogate (such as \\ud800 without its pair), "
                         "which is not valid Unicode text")
    return body


def served_model(model: str | None, served_names: list[str]) -> str:
    model = served_names[0] if model is None else model
    if model not in served_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{served_names}", param="model", code="model_not_found")
    return model


def _encode(llm, text: str, add_special_tokens: bool) -> list[int]:
    if not add_special_tokens:
        return llm.tokenize(text)[1]
    if llm.tokenizer is None:
        raise ValueError("this model has no tokenizer; pass the prompt as a list of token ids")
    return llm.tokenizer.encode(text, add_special_tokens=True)


def prepare_request(raw: bytes, chat: bool, llm, served_names: list[str],
                    prompt_chars_limit: int | None) -> GenerationRequest:
    """Parse, check, render and tokenize a request body (``APIError`` on bad input).

    ``llm`` is anything with ``tokenizer``, ``max_model_len``, ``tokenize(text)`` and
    ``validate(ids, params)`` (an ``LLMEngine``; the Ray backend's ingress passes a front
    that leaves the engine-side checks to the replica). Shared by the server and
    ``minibatch.cluster.ray_backend``."""
    req = parse_request(load_body(raw), chat, llm.tokenizer, llm.max_model_len, render=False)
    req.model = served_model(req.model, served_names)
    param = "messages" if chat else "prompt"
    limit = prompt_chars_limit
    ids_list, texts = [], []
    for k, prompt in enumerate([None] if chat else req.all_prompts()):
        where = param if chat or len(req.all_prompts()) == 1 else f"prompt[{k}]"
        if chat:
            chars = sum(len(m["content"]) for m in req.messages)
        else:
            chars = len(prompt) if isinstance(prompt, str) else 0
        if limit is not None and chars > limit:
            raise bad(param, f"the {where} of {chars} characters is too long: that many characters make "
                             f"more than max_model_len={llm.max_model_len} tokens with this tokenizer")
        text = render_chat(req.messages, llm.tokenizer) if chat else prompt
        try:
            ids = _encode(llm, text, req.add_special_tokens) if isinstance(text, str) else llm.tokenize(text)[1]
            llm.validate(ids, req.params)
        except ValueError as e:
            raise bad(param, str(e) if where == param else f"{where}: {e}") from None
        check_context(req, len(ids), llm.max_model_len)
        ids_list.append(ids)
        if req.echo:
            texts.append(text if isinstance(text, str) else
                         llm.tokenizer.decode(ids) if llm.tokenizer is not None else "")
    req.prompt, req.prompts, req.prompt_texts = ids_list[0], ids_list, texts or None
    return req


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_bytes(obj) -> bytes:
    return sse_event(obj).encode()
