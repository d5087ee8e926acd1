"""The HTTP router's stream relay: one streamed answer passed to the client event by event,
and resumed on another upstream if its upstream fails mid-way (``router.py``'s docstring
gives the rules).

:class:`StreamRelay` reads the upstream's server-sent events (:func:`sse_data`), fixes what
the client should see (one id, no token ids it did not ask for, usage and text of a resumed
stream) and, when the stream is cut, asks ``RouterState.send`` for another attempt.
:class:`RelayResponse` makes sure the attempt's upstream connection and the router's slot
are given back however the stream ends.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
from fastapi.responses import StreamingResponse

from minibatch.serving.openai import sse_bytes as sse
from minibatch.serving.protocol import APIError
from minibatch.serving.upstreams import UpstreamFailed

# What a resumed stream's client should not see unless it asked: the ids the router requests.
ID_FIELDS = ("token_ids", "prompt_token_ids")
IDS_RE = re.compile(r',\s*"token_ids"\s*:\s*\[([0-9,\s]*)\]')


async def sse_data(resp: aiohttp.ClientResponse):
    """The ``data:`` payloads of a server-sent event stream, as strings, one per event."""
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])     # one leading space is dropped


class StreamRelay:
    """Relays one streamed answer to the client, resuming it elsewhere if its upstream fails."""

    def __init__(self, state, req, u, resp: aiohttp.ClientResponse):
        self.state, self.req, self.u, self.resp = state, req, u, resp
        body = req.body
        self.want_ids = bool(body.get("return_token_ids"))
        temperature = body.get("temperature", 1.0)
        self.greedy = isinstance(temperature, (int, float)) and temperature == 0
        self.prompt_ids: list[int] | None = None
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            self.prompt_ids = list(p)
        self.produced: list[int] = []       # token ids relayed so far
        self.ids_known = True               # every relayed chunk carried its token ids
        self._texts: list[str] = []         # text relayed so far, in pieces
        self._raw: list[str] = []           # chunks relayed by the fast path, text not yet read
        self.detok = None                   # after a resume: the router's own detokenizer
        self.rid: str | None = None
        self.finish_seen = False
        self.segment = 0

    def _fix(self, obj: dict) -> dict:
        """A chunk as the client should see it (ids, usage and text of a resumed stream fixed)."""
        self._flush_raw()                    # keep the text pieces in order
        if self.rid is None:
            self.rid = obj.get("id")
        elif "id" in obj:
            obj["id"] = self.rid
        usage = obj.get("usage")
        if usage and self.segment and self.prompt_ids is not None:
            done = len(self.produced)
            usage.update(prompt_tokens=len(self.prompt_ids), completion_tokens=done,
                         total_tokens=len(self.prompt_ids) + done)
        for c in obj.get("choices") or []:
            ids = c.get("token_ids")
            if self.segment == 0 and c.get("prompt_token_ids") is not None and self.prompt_ids is None:
                self.prompt_ids = list(c["prompt_token_ids"])
            if ids is None:
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    self.ids_known = False
            else:
                self.produced += ids
                if self.detok is not None:
                    for t in ids:
                        self.detok.push(t)
                    sent = self.text
                    if self.detok.text.startswith(sent) and "text" in c:
                        c["text"] = self.detok.text[len(sent):]
            if "text" in c:
                self._texts.append(c["text"] or "")
            if c.get("finish_reason") is not None:
                self.finish_seen = True
            if self.segment and "prompt_token_ids" in c:
                del c["prompt_token_ids"]
            if not self.want_ids:
                for k in ID_FIELDS:
                    c.pop(k, None)
        return obj

    @property
    def text(self) -> str:
        """The text relayed so far (the fast path's chunks are parsed only when this is read)."""
        self._flush_raw()
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def _flush_raw(self) -> None:
        for data in self._raw:
            for c in json.loads(data).get("choices") or []:
                self._texts.append(c.get("text") or "")
        self._raw = []

    def fast(self, data: str) -> bytes | None:
        """An ordinary chunk of the first upstream, relayed without a JSON round trip: its token
        ids are read (and cut out if the client did not ask for them) with a regex. None: the
        chunk needs :meth:`_fix` (the first one, the last, usage, errors, or another layout)."""
        if (self.segment or self.rid is None or '"finish_reason":null' not in data or '"usage"' in data
                or '"prompt_token_ids"' in data or '"error"' in data):
            return None
        m = IDS_RE.search(data)
        if m is None or IDS_RE.search(data, m.end()) is not None:
            return None
        self.produced += [int(x) for x in m.group(1).split(",") if x.strip()]
        self._raw.append(data)
        out = data if self.want_ids else data[:m.start()] + data[m.end():]
        return b"data: " + out.encode() + b"\n\n"

    def resume_body(self) -> dict | None:
        """The request that continues this stream on another upstream, or None if it cannot."""
        body = dict(self.req.body)
        if not self.produced and self.ids_known and not self.text:
            return body                      # nothing relayed yet: send it again as it was
        if self.req.chat or not self.greedy or not self.ids_known or self.prompt_ids is None:
            return None
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else max_tokens
        left = max_tokens - len(self.produced)
        if left <= 0:
            return None
        body.update(prompt=self.prompt_ids + self.produced, max_tokens=left, return_token_ids=True)
        return body

    def why_not(self) -> str:
        if self.req.chat:
            return "a chat stream cannot be resumed on another upstream"
        if not self.greedy:
            return "only a greedy (temperature 0) completion stream can be resumed with the same tokens"
        if not self.ids_known or self.prompt_ids is None:
            return "the upstream did not return token ids (return_token_ids), so the stream cannot be resumed"
        return "no tokens left to generate"

    async def events(self):
        state, req = self.state, self.req
        try:
            while True:
                cut: UpstreamFailed | None = None
                try:
                    async for data in sse_data(self.resp):
                        if data.strip() == "[DONE]":
                            yield b"data: [DONE]\n\n"
                            return
                        quick = self.fast(data)
                        if quick is not None:
                            yield quick
                            continue
                        try:
                            obj = json.loads(data)
                        except ValueError:
                            yield f"data: {data}\n\n".encode()
                            continue
                        yield sse(self._fix(obj) if isinstance(obj, dict) else obj)
                    cut = UpstreamFailed("stream_cut", f"{self.u.url} ended the stream without [DONE]")
                except asyncio.TimeoutError:
                    cut = UpstreamFailed("timeout", f"{self.u.url} sent nothing for {state.upstream_timeout:g} s")
                except (aiohttp.ClientError, OSError, ValueError) as e:     # ValueError: a line over 64 KiB
                    cut = UpstreamFailed("stream_cut", f"{self.u.url} cut the stream: {type(e).__name__}: {e}")
                self.close_attempt()
                state.failed(self.u, cut)
                if self.finish_seen:          # every token arrived; only the end was lost
                    yield b"data: [DONE]\n\n"
                    return
                body = self.resume_body()
                if body is None:
                    yield self.error_event(f"the upstream stream failed ({cut}) and {self.why_not()}")
                    return
                kind = "resume" if self.produced else "retry"
                try:
                    self.u, self.resp = await state.send(req, body, lambda: None)
                except APIError as e:
                    yield self.error_event(f"the upstream stream failed ({cut}) and could not be resumed: "
                                           f"{e.message}")
                    return
                state.metrics.retries.labels(kind).inc()
                if self.resp.status != 200:
                    status = self.resp.status
                    text = (await self.resp.read()).decode("utf-8", "replace")
                    self.close_attempt()
                    yield self.error_event(f"resuming the stream failed: {status} {text[:300]}")
                    return
                if self.produced:
                    self.segment += 1
                    if self.detok is None and state.tokens is not None:
                        self.detok = state.tokens.detokenizer()
                        if self.detok is not None:
                            for t in self.produced:
                                self.detok.push(t)
        finally:
            self.close_attempt()

    def error_event(self, message: str) -> bytes:
        self.state.metrics.stream_errors.inc()
        err = APIError(502, message, type="server_error", code="upstream_stream_failed")
        return sse(err.body()) + b"data: [DONE]\n\n"

    def close_attempt(self) -> None:
        if self.resp is not None:
            self.resp.close()
            self.state.end(self.u, self.req)
            self.resp = None


class RelayResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` (also if the client left before the
    first byte, when the body's generator never starts)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
