"""API parity with vLLM's OpenAI server, through the official ``openai`` client against the
server's app in this process (no socket): the chat stream's first chunk, the options that
change the answer (n, seeds, logprobs, echo, several prompts, min_tokens, min_p, stop
strings kept, special tokens), what stays unsupported (a 400 naming the field), the
context check on ``max_tokens``, and ``/tokenize`` / ``/detokenize``.

Expected values come from the offline engine (greedy tokens are those of a single engine,
the invariant of ``test_correctness.py``) and, for log probabilities, from Hugging Face
``transformers`` run on the same embedded checkpoint. Deterministic: waits are on events
or conditions with generous deadlines, never on how fast the machine is."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from serving_utils import one_thread_llm, pace

from minibatch import LLM, SamplingParams
from minibatch.serving.async_engine import AsyncEngine
from minibatch.serving.metrics import ServingMetrics
from minibatch.serving.protocol import GenerationRequest, parse_request
from minibatch.serving.server import ServerState, build_app, sse_events

openai = pytest.importorskip("openai")

DEADLINE_S = 120
JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
EOS_PROMPT = "小明和他的狗"          # greedy: EOS (<|endoftext|>) is its 50th token


@pytest.fixture(scope="module")
def llm():
    """The offline reference: an engine of its own (the server's runs in its own thread)."""
    yield from one_thread_llm()


@pytest.fixture(scope="module")
def served(llm):
    """``(AsyncEngine, app)`` over a second tiny engine; stopped afterwards."""
    engine = LLM("tiny").engine
    ae = AsyncEngine(engine, ServingMetrics("tiny", engine.max_model_len))
    state = ServerState(ae, ["tiny"], 64, None, allowed_hosts=["127.0.0.1"], prepare_threads=2)
    yield ae, build_app(state)
    ae.shutdown()
    state.pool.shutdown(wait=True)
    assert not engine.requests and engine.kv.num_used_blocks == 0


def run(served, body):
    """``body(client, http)`` with an ``openai.AsyncOpenAI`` client and a raw httpx client."""
    _, app = served

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     headers=JSON, timeout=DEADLINE_S) as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0,
                                        http_client=http)
            return await body(client, http)

    return asyncio.run(main())


def offline(llm, prompts, **kw):
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**kw))]


def events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# -- 1. the chat stream's first chunk comes with the first token --------------------------------
def test_the_chat_role_chunk_is_sent_only_once_the_first_token_exists(served, llm):
    """With the engine held before its first step, the stream yields nothing (the old server
    sent the role chunk at once: a client timing its first chunk saw a fake early first
    token). Once a step has run, the role chunk and then the first token's chunk arrive."""
    ae, _ = served
    ids = [5, 6, 7]
    want = offline(llm, [ids], temperature=0.0, max_tokens=4, ignore_eos=True)[0]
    allowed = pace(ae.engine, DEADLINE_S)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        stream = await ae.add_request(ids, params, "chat-first")
        req = GenerationRequest(chat=True, model="tiny", prompt=ids, params=params, stream=True,
                                include_usage=False)
        gen = sse_events(ae, stream, req)
        first = asyncio.ensure_future(gen.__anext__())
        for _ in range(50):                         # let the generator run as far as it can
            await asyncio.sleep(0)
        assert not first.done(), "an event was sent before the engine produced any token"
        allowed.release()                           # one step: the first token
        role = json.loads((await asyncio.wait_for(first, DEADLINE_S))[len("data: "):])
        tokens_then = list(stream.token_ids)
        token = json.loads((await asyncio.wait_for(gen.__anext__(), DEADLINE_S))[len("data: "):])
        for _ in range(3):
            allowed.release()
        rest = [e async for e in gen]
        return role, tokens_then, token, rest

    try:
        role, tokens_then, token, rest = asyncio.run(main())
    finally:
        del ae.engine.step
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert tokens_then == want.token_ids[:1], "the role chunk went out with the first token, not before"
    assert token["choices"][0]["delta"]["content"] == llm.engine.tokenizer.decode(want.token_ids[:1])
    assert rest[-1] == "data: [DONE]\n\n"


# -- 2. options that change the answer ------------------------------------------------------------
def test_n_seeded_samples_are_independent_reproducible_and_seed_plus_index(served, llm):
    """n=3 with a seed: three choices, index 0..2, choice i equal to the offline engine's
    sample with seed + i (vLLM's parallel sampling); the same request again gives the same."""
    kw = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True}

    async def body(client, http):
        a, b = [await client.completions.create(model="tiny", prompt="Once upon a time", n=3, seed=7,
                                                temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True})
                for _ in range(2)]
        return a, b

    a, b = run(served, body)
    want = [offline(llm, ["Once upon a time"], seed=7 + i, **kw)[0].text for i in range(3)]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == want == [c.text for c in b.choices]
    assert len(set(want)) > 1, "the choices are independent samples"
    assert a.usage.prompt_tokens == 4 and a.usage.completion_tokens == 36


def test_several_prompts_in_one_request_each_get_their_choices(served, llm):
    """A list of strings, and a list of token-id lists: one choice per prompt (n=2: index
    prompt * n + i), each the offline engine's output for that prompt alone."""
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}

    async def body(client, http):
        texts = await client.completions.create(model="tiny", prompt=["The little cat", "Tom found a box"],
                                                temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
        ids = await client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, seed=3,
                                              temperature=0.8, max_tokens=6, extra_body={"ignore_eos": True})
        return texts, ids

    texts, ids = run(served, body)
    assert [c.text for c in texts.choices] == [o.text for o in offline(llm, ["The little cat", "Tom found a box"],
                                                                       **greedy)]
    assert [c.index for c in texts.choices] == [0, 1]
    sampled = {"temperature": 0.8, "max_tokens": 6, "ignore_eos": True}
    want = [offline(llm, [p], seed=3 + i, **sampled)[0].text for p in ([5, 6, 7], [8, 9]) for i in range(2)]
    assert [c.index for c in ids.choices] == [0, 1, 2, 3] and [c.text for c in ids.choices] == want
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 24


@pytest.fixture(scope="module")
def hf_logprobs():
    """``f(ids) -> [positions, vocab]`` log-softmax of Hugging Face's logits for the tiny model."""
    from transformers import AutoModelForCausalLM

    from minibatch.model.loader import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), torch_dtype=torch.float32).eval()

    def f(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return f


def test_completion_logprobs_are_the_raw_distributions_with_vllms_shape(served, llm, hf_logprobs):
    """``logprobs=3`` with temperature 1.5: per token its string, its log probability and a map
    of the sampled token plus the 3 most likely, all of the model's raw distribution (not
    the temperature's), and text offsets that add up the token strings."""
    tok = llm.engine.tokenizer
    prompt = [5, 6, 7, 8]

    async def body(client, http):
        return await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.5,
                                               seed=11, logprobs=3, extra_body={"ignore_eos": True})

    out = run(served, body).choices[0]
    ids = tok.encode(out.text, add_special_tokens=False)
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    want = offline(llm, [prompt], temperature=1.5, seed=11, max_tokens=8, ignore_eos=True)[0].token_ids
    assert tok.decode(want) == out.text and ids is not None
    ref = hf_logprobs(prompt + want)[len(prompt) - 1:-1]
    for i, t in enumerate(want):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i, t]), abs=2e-3)
        top = ref[i].topk(3)
        expected = {tok.decode([t]): float(ref[i, t])}
        expected.update({tok.decode([j]): float(v) for j, v in zip(top.indices.tolist(), top.values.tolist())})
        assert lp.top_logprobs[i].keys() == expected.keys()
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(expected.values()), abs=2e-3)


def test_chat_logprobs_have_openais_content_shape(served, llm, hf_logprobs):
    async def body(client, http):
        return await client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0,
                                                    logprobs=True, top_logprobs=2,
                                                    extra_body={"ignore_eos": True})

    out = run(served, body).choices[0]
    tok = llm.engine.tokenizer
    prompt = tok.apply_chat_template(HI, add_generation_prompt=True)["input_ids"]
    want = offline(llm, [prompt], temperature=0.0, max_tokens=5, ignore_eos=True)[0].token_ids
    ref = hf_logprobs(prompt + want)[len(prompt) - 1:-1]
    content = out.logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in want]
    for i, c in enumerate(content):
        assert c.bytes == list(c.token.encode("utf-8", errors="replace"))
        assert c.logprob == pytest.approx(float(ref[i, want[i]]), abs=2e-3)
        top = ref[i].topk(2)
        assert [x.token for x in c.top_logprobs] == [tok.decode([j]) for j in top.indices.tolist()]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert c.top_logprobs[0].token == c.token, "greedy: the most likely token is the one chosen"


def test_streamed_chat_n2_with_logprobs_and_continuous_usage(served, llm):
    """Two streamed choices: both role chunks first, then each choice's tokens under its own
    index, each chunk's usage counting that choice's tokens so far, the text and logprobs
    of each choice those of the same request unstreamed."""
    kw = {"model": "tiny", "messages": HI, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2, "logprobs": True,
              "top_logprobs": 1, "extra_body": {"ignore_eos": True}}

    async def body(client, http):
        chunks = [c async for c in await client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})]
        whole = await client.chat.completions.create(**kw)
        return chunks, whole

    chunks, whole = run(served, body)
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert chunks[:2] == roles and sorted(c.choices[0].index for c in roles) == [0, 1]
    assert all(c.usage.completion_tokens == 0 for c in roles)
    for i in range(2):
        mine = [c for c in chunks[2:] if c.choices and c.choices[0].index == i]
        assert "".join(c.choices[0].delta.content for c in mine) == whole.choices[i].message.content
        got = [x.logprob for c in mine for x in c.choices[0].logprobs.content]
        # the same tokens; another batch mix may change the float sums in the last digits
        assert got == pytest.approx([x.logprob for x in whole.choices[i].logprobs.content], abs=1e-4)
        counts = [c.usage.completion_tokens for c in mine]
        assert counts == sorted(counts) and counts[-1] == 6
        assert mine[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_streamed_completions_of_two_prompts_count_usage_per_choice_and_in_total(served, llm):
    async def body(client, http):
        return [c async for c in await client.completions.create(
            model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True})]

    chunks = run(served, body)
    want = offline(llm, [[5, 6, 7], [8, 9]], temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, prompt_len in enumerate((3, 2)):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.choices[0].text for c in mine) == want[i].text
        assert all(c.usage.prompt_tokens == prompt_len for c in mine) and mine[-1].usage.completion_tokens == 5
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 10)


def test_echo_puts_the_prompt_before_the_completion(served, llm):
    async def body(client, http):
        whole = await client.completions.create(model="tiny", prompt="The little cat", max_tokens=4,
                                                temperature=0, echo=True)
        streamed = [c async for c in await client.completions.create(
            model="tiny", prompt="The little cat", max_tokens=4, temperature=0, echo=True, stream=True)]
        return whole, streamed

    whole, streamed = run(served, body)
    text = offline(llm, ["The little cat"], temperature=0.0, max_tokens=4)[0].text
    assert whole.choices[0].text == "The little cat" + text
    assert streamed[0].choices[0].text.startswith("The little cat")
    assert "".join(c.choices[0].text for c in streamed) == "The little cat" + text


def test_min_tokens_holds_off_eos_and_skip_special_tokens_shows_it(served, llm):
    """Greedy EOS_PROMPT ends with EOS as its 50th token. min_tokens=60 masks EOS until 60
    tokens exist; with ignore_eos the EOS is generated, and shows as text only with
    skip_special_tokens=false."""
    alone = offline(llm, [EOS_PROMPT], temperature=0.0, max_tokens=64)[0]
    assert len(alone.token_ids) == 50 and alone.finish_reason == "stop", "the tiny model changed"
    eos_text = llm.engine.tokenizer.decode([alone.token_ids[-1]])

    async def body(client, http):
        held = await client.completions.create(model="tiny", prompt=EOS_PROMPT, max_tokens=64, temperature=0,
                                               extra_body={"min_tokens": 60})
        shown = await client.completions.create(model="tiny", prompt=EOS_PROMPT, max_tokens=50, temperature=0,
                                                extra_body={"ignore_eos": True, "skip_special_tokens": False})
        hidden = await client.completions.create(model="tiny", prompt=EOS_PROMPT, max_tokens=50, temperature=0,
                                                 extra_body={"ignore_eos": True})
        return held, shown, hidden

    held, shown, hidden = run(served, body)
    assert held.usage.completion_tokens >= 60 and held.choices[0].text.startswith(alone.text)
    assert held.choices[0].text != alone.text
    assert shown.choices[0].text == alone.text + eos_text and eos_text.startswith("<|")
    assert hidden.choices[0].text == alone.text


def test_include_stop_str_in_output_keeps_the_stop_string(served, llm):
    text = offline(llm, ["Once upon a time"], temperature=0.0, max_tokens=24, ignore_eos=True)[0].text
    stop = text[10:14]

    async def body(client, http):
        kw = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": [stop]}
        cut = await client.completions.create(**kw)
        kept = await client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
        streamed = [c async for c in await client.completions.create(
            **kw, stream=True, extra_body={"include_stop_str_in_output": True})]
        return cut, kept, streamed

    cut, kept, streamed = run(served, body)
    i = text.index(stop)
    assert cut.choices[0].text == text[:i] and kept.choices[0].text == text[:i + len(stop)]
    assert "".join(c.choices[0].text for c in streamed) == text[:i + len(stop)]
    assert kept.choices[0].finish_reason == "stop" and kept.choices[0].stop_reason == stop


def test_min_p_1_keeps_only_the_most_likely_token(served, llm):
    """min_p=1 drops every token less likely than the most likely one: sampling at any
    temperature then gives the greedy tokens."""
    want = offline(llm, [[5, 6, 7]], temperature=0.0, max_tokens=10, ignore_eos=True)[0].text

    async def body(client, http):
        return await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=10, temperature=1.3,
                                               extra_body={"min_p": 1.0, "ignore_eos": True})

    assert run(served, body).choices[0].text == want


def test_sampled_and_logprob_requests_leave_a_greedy_neighbours_tokens_unchanged(served, llm):
    want = offline(llm, ["Tom found a box"], temperature=0.0, max_tokens=16, ignore_eos=True)[0].text

    async def body(client, http):
        noisy = client.completions.create(model="tiny", prompt="The little cat", n=4, temperature=1.0,
                                          max_tokens=16, logprobs=5,
                                          extra_body={"min_p": 0.1, "min_tokens": 4, "ignore_eos": True})
        greedy = client.completions.create(model="tiny", prompt="Tom found a box", max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
        return await asyncio.gather(noisy, greedy)

    noisy, greedy = run(served, body)
    assert greedy.choices[0].text == want and len(noisy.choices) == 4


# -- 3. what is not implemented, and the context --------------------------------------------------
@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs", "prompt"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "temprature": 0.5}, "temprature", "unrecognized"),
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 5}, "max_completion_tokens", "chat"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options",
     "stream=True"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, "stream_options",
     "unrecognized"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p", "min_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": "no"}, "skip_special_tokens", "boolean"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_object"}}, "response_format",
     "json_object"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/chat/completions", {"messages": HI, "echo": True}, "echo", "echo"),
    ("/v1/chat/completions", {"messages": HI, "add_generation_prompt": False}, "add_generation_prompt",
     "not implemented"),
])
def test_what_is_not_implemented_gets_a_400_naming_it(served, path, body, param, words):
    async def go(client, http):
        return await http.post(path, json=body)

    r = run(served, go)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_max_tokens_beyond_the_context_is_a_400_with_vllms_message(served, llm):
    ids = list(range(5, 5 + 1000))                 # max_model_len is 1024

    async def go(client, http):
        over = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 25})
        fits = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 24, "ignore_eos": True})
        chat = await http.post("/v1/chat/completions", json={"messages": HI, "max_completion_tokens": 2000})
        return over, fits, chat

    over, fits, chat = run(served, go)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert over.json()["error"]["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 25. This model's maximum context length is "
        "1024 tokens and your request has 1000 input tokens (25 > 1024 - 1000).")
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 24
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"


def test_a_chat_without_max_tokens_may_run_to_the_end_of_the_context(llm):
    from minibatch.serving.protocol import check_context

    req = parse_request({"messages": HI}, chat=True, tokenizer=llm.engine.tokenizer, default_max_tokens=1024)
    assert req.max_tokens_param is None
    check_context(req, 9, 1024)
    assert req.params.max_tokens == 1024 - 9


# -- /tokenize and /detokenize ---------------------------------------------------------------------
def test_tokenize_and_detokenize_have_vllms_shapes(served, llm):
    tok = llm.engine.tokenizer

    async def go(client, http):
        text = await http.post("/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True})
        chat = await http.post("/tokenize", json={"messages": HI})
        back = await http.post("/detokenize", json={"tokens": text.json()["tokens"]})
        bad = await http.post("/detokenize", json={"tokens": [5, 10 ** 6]})
        form = await http.post("/tokenize", content="prompt=hi", headers={"Content-Type": "text/plain"})
        return text, chat, back, bad, form

    text, chat, back, bad, form = run(served, go)
    ids = tok.encode("Once upon a time")
    assert text.json() == {"count": len(ids), "max_model_len": 1024, "tokens": ids,
                           "token_strs": tok.convert_ids_to_tokens(ids)}
    chat_ids = tok.apply_chat_template(HI, add_generation_prompt=True)["input_ids"]
    assert chat.json() == {"count": len(chat_ids), "max_model_len": 1024, "tokens": chat_ids, "token_strs": None}
    assert back.json() == {"prompt": "Once upon a time"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert form.status_code == 415


@pytest.mark.parametrize("body, chat, field", [
    ({"prompt": "x", "max_tokens": 5, "min_tokens": 10}, False, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 5, "min_tokens": 10}, True, "max_completion_tokens"),
    ({"messages": HI, "max_tokens": 5, "min_tokens": 10}, True, "max_tokens"),
])
def test_min_tokens_above_max_tokens_names_both_fields_right(body, chat, field):
    from minibatch.serving.protocol import APIError

    with pytest.raises(APIError) as e:
        parse_request(body, chat=chat)
    assert e.value.status == 400 and e.value.param == "min_tokens"
    assert "min_tokens=10" in e.value.message and f"[0, {field}=5]" in e.value.message

