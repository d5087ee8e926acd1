"""The HTTP router's stream relay: one streamed answer passed to the client event by event,
and resumed on other upstreams, choice by choice, when its upstream fails mid-way.

:class:`StreamRelay` reads the upstream's server-sent events (:func:`sse_data`, under the
first-token and inter-token timeouts) and fixes what the client should see: one ``id``, no
token ids it did not ask for, and the ids, text, usage and log-probability offsets of a
resumed choice. A request may carry several choices (several prompts, or ``n``); the relay
follows each choice (:class:`ChoiceState`): its prompt's token ids, the tokens and text
relayed, its ``finish_reason``.

When an upstream stream ends without ``[DONE]``, stalls, or errs (a :class:`Part` is cut):

- nothing relayed yet: the same request goes to another upstream as it was (a retry);
- a greedy completion (``temperature`` 0): every choice of the cut part that has not
  finished continues on its own, as a request of its own on another upstream: ``prompt`` =
  its prompt's ids + the tokens already relayed, ``max_tokens`` (and ``min_tokens``) reduced
  by their number, ``echo`` off (the client has the prompt already); a choice that had not
  started is sent as it was (its own prompt, ``echo`` as asked). The continuations stream
  side by side (each a :class:`Part`) and their events are merged, so that each choice's
  tokens equal those of an uninterrupted answer, with its own ``finish_reason``. When the
  router has the tokenizer it detokenizes a continued choice itself, so that a character
  split across the cut is not lost;
- a chat stream, sampling (``temperature`` > 0), an upstream that sent no token ids: the
  stream ends with an error event in OpenAI's shape and ``data: [DONE]``.

Once any choice has continued elsewhere the upstreams' usage chunks are dropped and the
relay sends its own at the end (``stream_options.include_usage``): the prompts' tokens once
per prompt, every choice's tokens relayed. A stream is never silently short: it ends with
every choice's ``finish_reason`` and the usage asked for, or with an error event.

:class:`RelayResponse` makes sure the upstream connections and the router's slot are given
back however the stream ends (a client that leaves closes them: the upstreams then abort).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field

import aiohttp
from fastapi.responses import StreamingResponse

from minibatch.sampling_params import GREEDY_BELOW_TEMPERATURE
from minibatch.serving.openai import sse_bytes as sse
from minibatch.serving.protocol import APIError
from minibatch.serving.upstreams import UpstreamFailed

# What a resumed stream's client should not see unless it asked: the ids the router requests.
ID_FIELDS = ("token_ids", "prompt_token_ids")
IDS_RE = re.compile(r',\s*"token_ids"\s*:\s*\[([0-9,\s]*)\]')
DONE = b"data: [DONE]\n\n"
MERGE_QUEUE = 64            # events read ahead from continuations running side by side


class _Watchdog:
    """A stream's stall deadline, armed lazily: reading an event only notes the time, and one
    timer, re-armed when it fires early, closes the response once ``limit`` seconds pass
    without an event (a per-read ``asyncio.timeout`` cost more than the rest of relaying an
    event). The time the relay spends handing an event to a slow client does not count."""

    def __init__(self, resp: aiohttp.ClientResponse, limit: float | None):
        self.resp, self.limit = resp, limit
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.paused = False
        self.expired = False
        self.handle = None if limit is None else self.loop.call_at(self.last + limit, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.paused:
            self.handle = self.loop.call_at(now + self.limit, self._check)
        elif now >= self.last + self.limit:
            self.expired = True
            self.handle = None
            self.resp.close()                # the pending read ends; sse_data raises TimeoutError
        else:
            self.handle = self.loop.call_at(self.last + self.limit, self._check)

    def event(self, limit: float | None) -> None:
        """An event arrived; from now on the deadline is ``limit`` after the latest one."""
        self.last = self.loop.time()
        if limit != self.limit:
            self.cancel()
            self.limit = limit
            if limit is not None:
                self.handle = self.loop.call_at(self.last + limit, self._check)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


async def sse_data(resp: aiohttp.ClientResponse, first_timeout: float | None = None,
                   idle_timeout: float | None = None):
    """The ``data:`` payloads of a server-sent event stream, as strings, one per event.
    ``asyncio.TimeoutError`` if the first event takes more than ``first_timeout`` seconds,
    or a later one more than ``idle_timeout`` after the previous one."""
    data: list[str] = []
    dog = _Watchdog(resp, first_timeout)
    try:
        async for raw in resp.content:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line:
                if data:
                    dog.event(idle_timeout)
                    dog.paused = True
                    yield "\n".join(data)
                    dog.paused = False
                    dog.last = dog.loop.time()
                    data = []
            elif line.startswith("data:"):
                data.append(line[6:] if line[5:6] == " " else line[5:])     # one leading space is dropped
    except (aiohttp.ClientError, OSError):
        if not dog.expired:
            raise
    finally:
        dog.cancel()
    if dog.expired:
        raise asyncio.TimeoutError


@dataclass
class ChoiceState:
    """One choice of the client's answer, as relayed so far."""

    index: int
    prompt: object                      # its prompt as the client sent it (text or ids)
    echo: str | None = None             # the echoed prompt text its first chunk starts with
    prompt_ids: list[int] | None = None
    produced: list[int] = field(default_factory=list)
    text: str = ""                      # generated text relayed (the echo left out)
    raw: list[str] = field(default_factory=list)    # fast-path chunks whose text is not read yet
    started: bool = False
    ids_known: bool = True              # every chunk with text carried its token ids
    finish_reason: str | None = None
    detok: object = None                # the router's own detokenizer, once continued elsewhere
    offset_base: int = 0                # logprobs text_offset of its current continuation


@dataclass
class Part:
    """One upstream stream of this answer: the first, or a retry or continuation."""

    u: object
    resp: aiohttp.ClientResponse | None
    req: object                         # the Proxied sent (its attempts and tried upstreams)
    choices: list[int] | None = None    # client index of each of its choices (None: the same)
    continued: frozenset = frozenset()  # client indices it continues (their prompt was sent already)
    outcome: object = None              # "done", "error" or the UpstreamFailed that cut it

    def client_index(self, j: int) -> int:
        return j if self.choices is None else self.choices[j]


class StreamRelay:
    """Relays one streamed answer to the client, resuming it elsewhere if its upstream fails."""

    def __init__(self, state, req, u, resp: aiohttp.ClientResponse):
        self.state, self.req = state, req
        body = req.body
        self.want_ids = bool(body.get("return_token_ids"))
        temperature = body.get("temperature", 1.0)
        self.greedy = (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                       and temperature < GREEDY_BELOW_TEMPERATURE)
        n = body.get("n")
        self.n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        self.prompts = self._prompts(body)
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        self.choices = [ChoiceState(k, self.prompts[k // self.n]) for k in range(len(self.prompts) * self.n)]
        if body.get("echo") is True:
            for ch in self.choices:
                ch.echo = ch.prompt if isinstance(ch.prompt, str) else (
                    state.tokens.decode(ch.prompt) if state.tokens is not None else None)
        if len(self.prompts) == 1 and isinstance(self.prompts[0], list):
            for ch in self.choices:
                ch.prompt_ids = list(self.prompts[0])
        self.first = Part(u, resp, req)
        self.parts: list[Part] = [self.first]
        self.tasks: list[asyncio.Task] = []
        self.rid: str | None = None
        self.head: dict = {}                # object, created, model of the first chunk
        self.segmented = False              # a choice continued elsewhere: usage is the relay's
        self.usage_sent = False
        self.error_sent = False
        self.ended = False                  # the stream's end (an error event) was sent

    @staticmethod
    def _prompts(body: dict) -> list:
        p = body.get("messages") if "messages" in body else body.get("prompt")
        if "messages" in body or isinstance(p, str) or not isinstance(p, list) or not p:
            return [p]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [p]
        return list(p)

    # -- what the client sees -----------------------------------------------------------------
    def _fix(self, part: Part, obj: dict) -> dict | None:
        """A chunk as the client should see it; None drops it (a continuation's usage chunk)."""
        self._flush_raw()                    # keep each choice's text in order
        if self.rid is None:
            self.rid = obj.get("id")
            self.head = {k: obj[k] for k in ("object", "created", "model") if k in obj}
        elif "id" in obj:
            obj["id"] = self.rid
        choices = obj.get("choices")
        if not choices:
            if "usage" in obj:
                if self.segmented:
                    return None              # the relay sends the whole answer's usage at the end
                self.usage_sent = True
            return obj
        for c in choices:
            k = part.client_index(c.get("index", 0))
            c["index"] = k
            if not 0 <= k < len(self.choices):
                continue
            self._fix_choice(part, self.choices[k], c, obj)
        return obj

    def _fix_choice(self, part: Part, ch: ChoiceState, c: dict, obj: dict) -> None:
        continued = ch.index in part.continued
        if c.get("prompt_token_ids") is not None and not continued and ch.prompt_ids is None:
            ch.prompt_ids = list(c["prompt_token_ids"])
        if continued:
            c.pop("prompt_token_ids", None)  # the client saw its prompt's ids once already
        ids = c.get("token_ids")
        text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
        if ids is None:
            if text:
                ch.ids_known = False
        else:
            ch.produced += ids
            if continued and ch.detok is not None:
                for t in ids:
                    ch.detok.push(t)
                if "text" in c and ch.detok.text.startswith(ch.text):
                    c["text"] = ch.detok.text[len(ch.text):]
        if "text" in c:
            piece = c["text"] or ""
            if not ch.started and ch.echo and piece.startswith(ch.echo):
                piece = piece[len(ch.echo):]
            if continued and ch.offset_base and isinstance(c.get("logprobs"), dict):
                offsets = c["logprobs"].get("text_offset")
                if isinstance(offsets, list):
                    c["logprobs"]["text_offset"] = [o + ch.offset_base for o in offsets]
            ch.text += piece
        if part.choices is not None and isinstance(obj.get("usage"), dict) and ch.prompt_ids is not None:
            obj["usage"] = _usage(len(ch.prompt_ids), len(ch.produced))    # continuous_usage_stats
        if c.get("finish_reason") is not None:
            ch.finish_reason = c["finish_reason"]
        ch.started = True
        if not self.want_ids:
            for k in ID_FIELDS:
                c.pop(k, None)

    def _flush_raw(self) -> None:
        for ch in self.choices:
            for data in ch.raw:
                for c in json.loads(data).get("choices") or []:
                    ch.text += c.get("text") or ""
            ch.raw = []

    def fast(self, part: Part, data: str) -> bytes | None:
        """An ordinary chunk of a one-choice answer's (first or retried) stream, relayed without a JSON round
        trip: its token ids are read (and cut out if the client did not ask for them) with a
        regex. None: the chunk needs :meth:`_fix` (the first one, the last, usage, errors, or
        another layout)."""
        if (part.choices is not None or len(self.choices) != 1 or self.rid is None
                or '"finish_reason":null' not in data or '"usage"' in data
                or '"prompt_token_ids"' in data or '"error"' in data):
            return None
        m = IDS_RE.search(data)
        if m is None or IDS_RE.search(data, m.end()) is not None:
            return None
        ch = self.choices[0]
        ch.produced += [int(x) for x in m.group(1).split(",") if x.strip()]
        ch.raw.append(data)
        out = data if self.want_ids else data[:m.start()] + data[m.end():]
        return b"data: " + out.encode() + b"\n\n"

    # -- one upstream stream --------------------------------------------------------------------
    async def _relay(self, part: Part):
        """The client's events from one part; sets ``part.outcome`` when it ends."""
        state = self.state
        try:
            async for data in sse_data(part.resp, state.first_token_timeout, state.inter_token_timeout):
                if data.strip() == "[DONE]":
                    part.outcome = "done"
                    return
                quick = self.fast(part, data)
                if quick is not None:
                    yield quick
                    continue
                try:
                    obj = json.loads(data)
                except ValueError:
                    yield f"data: {data}\n\n".encode()
                    continue
                if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
                    self.error_sent = True   # the upstream's own error event: passed on, and the end
                    yield sse(obj)
                    if self.segmented:
                        part.outcome = "error"
                        return
                    continue
                out = self._fix(part, obj) if isinstance(obj, dict) else obj
                if out is not None:
                    yield sse(out)
            part.outcome = UpstreamFailed("stream_cut", f"{part.u.url} ended the stream without [DONE]")
        except asyncio.TimeoutError:
            waited = state.inter_token_timeout if self.choices_started(part) else state.first_token_timeout
            part.outcome = UpstreamFailed("stall", f"{part.u.url} sent nothing for {waited:g} s "
                                                   "(--first-token-timeout / --inter-token-timeout)")
        except (aiohttp.ClientError, OSError, ValueError) as e:     # ValueError: a line over 64 KiB
            part.outcome = UpstreamFailed("stream_cut", f"{part.u.url} cut the stream: {type(e).__name__}: {e}")

    def choices_started(self, part: Part) -> bool:
        ks = range(len(self.choices)) if part.choices is None else part.choices
        return any(self.choices[k].started for k in ks)

    # -- resumption -----------------------------------------------------------------------------
    def why_not(self, ch: ChoiceState) -> str | None:
        """Why choice ``ch`` cannot continue elsewhere with the same tokens (None: it can)."""
        if self.req.chat:
            return "a chat stream cannot be resumed on another upstream"
        if not self.greedy:
            return "only a greedy (temperature 0) completion stream can be resumed with the same tokens"
        if ch.started and (not ch.ids_known or ch.prompt_ids is None):
            return "the upstream did not return token ids (return_token_ids), so the stream cannot be resumed"
        return None

    def choice_body(self, ch: ChoiceState) -> dict:
        """The request that continues choice ``ch`` alone (or sends it afresh, if not started)."""
        body = dict(self.req.body)
        body["prompt"] = ch.prompt
        body.pop("n", None)
        if not ch.started:
            return body
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else max_tokens
        body.update(prompt=ch.prompt_ids + ch.produced, max_tokens=max_tokens - len(ch.produced), echo=False,
                    return_token_ids=True)
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens:
            body["min_tokens"] = max(0, min_tokens - len(ch.produced))
        return body

    async def resume(self, part: Part) -> list[Part] | bytes:
        """The parts that carry on after ``part`` was cut, or the error event that ends the stream."""
        state, cut = self.state, part.outcome
        self.close_part(part)
        state.failed(part.u, cut)
        self._flush_raw()
        ks = list(range(len(self.choices))) if part.choices is None else part.choices
        todo = [self.choices[k] for k in ks if self.choices[k].finish_reason is None]
        if not todo:
            return []                        # every token arrived; only the end was lost
        plans: list[tuple[list[int] | None, dict, bool]] = []
        if part.choices is None and not any(self.choices[k].started for k in ks):
            plans.append((None, dict(part.req.body), False))        # nothing relayed: send it again
        else:
            for ch in todo:
                why = self.why_not(ch)
                if why is not None:
                    return self.error_event(f"the upstream stream failed ({cut}) and {why}")
                left = self.choice_body(ch).get("max_tokens")
                if isinstance(left, int) and left <= 0:
                    return self.error_event(f"the upstream stream failed ({cut}) after the last token of "
                                            f"choice {ch.index} but before its finish_reason")
                plans.append(([ch.index], self.choice_body(ch), ch.started))
        new: list[Part] = []
        for choices, body, continues in plans:
            req = dataclasses.replace(part.req, body=body, tried=set(part.req.tried))
            try:
                u, resp = await state.send(req, body, lambda: None)
            except APIError as e:
                for p in new:
                    self.close_part(p)
                return self.error_event(f"the upstream stream failed ({cut}) and could not be resumed: {e.message}")
            state.metrics.retries.labels("resume" if continues else "retry").inc()
            p = Part(u, resp, req, choices, frozenset(choices) if continues else frozenset())
            self.parts.append(p)
            new.append(p)
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                for q in new:
                    self.close_part(q)
                return self.error_event(f"resuming the stream failed: {resp.status} {text[:300]}")
        for p in new:
            for k in p.continued:
                self._continue(self.choices[k])
        if any(p.choices is not None for p in new):
            self.segmented = True
        return new

    def _continue(self, ch: ChoiceState) -> None:
        ch.offset_base = len(ch.text)
        if ch.detok is None and self.state.tokens is not None:
            skip = self.req.body.get("skip_special_tokens", True)
            ch.detok = self.state.tokens.detokenizer(ch.prompt_ids, skip is not False)
            if ch.detok is not None:
                for t in ch.produced:
                    ch.detok.push(t)

    # -- the whole answer ------------------------------------------------------------------------
    async def events(self):
        active = [self.first]
        try:
            while len(active) == 1:          # one stream at a time: read it here
                part = active[0]
                async for out in self._relay(part):
                    yield out
                if part.outcome == "done" and not self.segmented:
                    yield DONE               # the upstream's answer, whole
                    return
                if part.outcome in ("done", "error"):
                    active = []
                    break
                r = await self.resume(part)
                if isinstance(r, bytes):
                    yield r
                    return
                active = r
            if active:                       # several choices continue side by side: merge them
                async for out in self._merged(active):
                    yield out
            if not self.ended:
                yield self.finish()
        finally:
            self.close()

    async def _merged(self, parts: list[Part]):
        queue: asyncio.Queue = asyncio.Queue(MERGE_QUEUE)

        async def pump(p: Part) -> None:
            try:
                async for out in self._relay(p):
                    await queue.put((p, out))
            finally:
                await queue.put((p, None))

        running = 0

        def start(p: Part) -> None:
            nonlocal running
            running += 1
            self.tasks.append(asyncio.ensure_future(pump(p)))

        for p in parts:
            start(p)
        while running:
            p, out = await queue.get()
            if out is not None:
                yield out
                continue
            running -= 1
            if p.outcome == "error":
                return                       # the error event went out; finish() ends the stream
            if p.outcome == "done":
                continue
            r = await self.resume(p)
            if isinstance(r, bytes):
                self.ended = True
                yield r
                return
            for q in r:
                start(q)

    def finish(self) -> bytes:
        """The end of the answer: usage if asked (and not sent), then ``[DONE]``; an error event
        instead if a choice has no finish_reason or the usage cannot be known."""
        if self.error_sent:
            return DONE
        missing = [ch.index for ch in self.choices if ch.finish_reason is None]
        if missing:
            return self.error_event(f"the upstream streams ended without the end of choice(s) {missing}")
        if self.include_usage and not self.usage_sent:
            firsts = [self.choices[k * self.n] for k in range(len(self.prompts))]
            if any(ch.prompt_ids is None for ch in firsts) or not all(ch.ids_known for ch in self.choices):
                return self.error_event("the upstream stream failed after the last token and its usage is not "
                                        "known (the upstream sent no token ids)")
            total = _usage(sum(len(ch.prompt_ids) for ch in firsts), sum(len(ch.produced) for ch in self.choices))
            out = {"id": self.rid, **self.head, "created": self.head.get("created", int(time.time())),
                   "choices": [], "usage": total}
            return sse(out) + DONE
        return DONE

    def error_event(self, message: str) -> bytes:
        self.state.metrics.stream_errors.inc()
        err = APIError(502, message, type="server_error", code="upstream_stream_failed")
        return sse(err.body()) + DONE

    # -- closing ----------------------------------------------------------------------------------
    def close_part(self, part: Part) -> None:
        if part.resp is not None:
            part.resp.close()                # the upstream sees the connection close and aborts
            self.state.end(part.u, part.req)
            part.resp = None

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.tasks = []
        for p in self.parts:
            self.close_part(p)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
