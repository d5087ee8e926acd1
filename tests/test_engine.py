"""One small, hand-made case per rule of ``minibatch.engine``: the step, stop conditions,
events, validation, abort and reject. The executor is scripted (it emits the tokens a
test asks for, in a fixed time per step), so every expected value is worked out by hand."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from minibatch.admission import Overloaded
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.executor import StepOutput
from minibatch.request import RequestStatus
from minibatch.sampling_params import SamplingParams

EOS = 2
STEP_S = 0.5


class Scripted:
    """Emits ``script[request_id][i]`` as a request's i-th output token (default token 5)."""

    def __init__(self, num_kv_blocks=64, max_len=64, vocab_size=128, script=None):
        self.num_kv_blocks = num_kv_blocks
        self.model_config = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=vocab_size,
                                            max_position_embeddings=max_len, sliding_window=None)
        self.script = script or {}
        self.batches = []

    def execute(self, batch, kv):
        self.batches.append([(r.request_id, n) for r, n in batch.items])
        sampled = []
        for r, n in batch.items:
            if r.num_computed_tokens + n == r.num_tokens:
                seq = self.script.get(r.request_id, [])
                i = r.num_output_tokens
                sampled.append((r, seq[i] if i < len(seq) else 5))
        return StepOutput(sampled, STEP_S, STEP_S)


class Chars:
    """A tokenizer whose token ``i`` is the character ``chr(ord('a') + i - 10)`` (ids 10..35);
    a few ids decode to several characters at once (``MULTI``), as real BPE tokens do."""

    MULTI = {40: "rs", 41: "xx", 42: "ab"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.MULTI.get(i, chr(ord("a") + i - 10) if 10 <= i < 36 else "") for i in ids)


def ids(text: str) -> list[int]:
    return [ord(ch) - ord("a") + 10 for ch in text]


def engine(script=None, tokenizer=False, events=None, **cfg) -> LLMEngine:
    ex = Scripted(num_kv_blocks=cfg.pop("num_kv_blocks", 64), max_len=cfg.pop("model_max_len", 64),
                  script=script)
    e = LLMEngine(EngineConfig.from_kwargs(block_size=4, **cfg), clock="virtual", executor=ex)
    if tokenizer:
        e.tokenizer = Chars()
    if events is not None:
        e.subscribe(lambda ev, t, r, info: events.append((ev, t, r.request_id)))
    return e


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def drain(e: LLMEngine, limit: int = 100) -> int:
    """Step until nothing is left, at most ``limit`` calls (a bound that always holds)."""
    for n in range(limit):
        if not e.has_unfinished_requests():
            return n
        e.step()
    raise AssertionError(f"engine still busy after {limit} steps")


# -- the step ------------------------------------------------------------------------------------------
def test_a_step_computes_its_tokens_and_returns_the_requests_that_got_one():
    e = engine(max_num_batched_tokens=6)
    a = e.add_request([10, 11, 12, 13], greedy(), request_id="a")
    b = e.add_request([20, 21, 22, 23], greedy(), request_id="b")
    touched = e.step()                                   # a: 4 tokens, b: a chunk of 2
    ra, rb = e.requests[a], e.requests[b]
    assert [r.request_id for r in touched] == ["a"]
    assert (ra.num_computed_tokens, rb.num_computed_tokens) == (4, 2)
    assert ra.output_token_ids == [5] and rb.output_token_ids == []
    assert ra.token_times == [STEP_S] and ra.first_token_time == STEP_S and e.clock.now() == STEP_S
    touched = e.step()                                   # a decodes; b finishes its prompt
    assert sorted(r.request_id for r in touched) == ["a", "b"]


def test_the_step_record_counts_the_step():
    e = engine(max_num_batched_tokens=6)
    e.add_request([10, 11, 12, 13], greedy(), request_id="a")
    e.add_request([20, 21, 22, 23, 24, 25, 26], greedy(), request_id="b")
    e.step()                                             # a 4 (prefill), b 2
    e.step()                                             # a 1 (decode), b 5 (rest of its prompt)
    s0, s1 = e.steps
    assert (s0.num_seqs, s0.num_prefill_tokens, s0.num_decode_tokens, s0.num_prefill_seqs) == (2, 6, 0, 2)
    assert (s1.num_seqs, s1.num_prefill_tokens, s1.num_decode_tokens, s1.num_decode_seqs) == (2, 5, 1, 1)
    assert (s0.start_time, s0.duration, s1.start_time) == (0.0, STEP_S, STEP_S)
    assert s1.kv_blocks_used == 2 + 2 and s1.kv_blocks_total == 64       # a: 5 tokens, b: 8 tokens
    assert (s1.num_waiting, s1.num_running, s1.num_preempted) == (0, 2, 0)
    assert s1.kv_internal_waste == pytest.approx((3 + 1) / (64 * 4))      # a computed 5 of 8 slots, b 7 of 8
    assert s1.policy == "continuous"


def test_a_step_with_nothing_to_run_records_nothing():
    e = engine()
    assert e.step() == [] and e.steps == []
    e = engine(policy="dynamic", max_wait_ms=1000, max_num_seqs=4)
    e.add_request([10, 11], greedy())                    # the window holds it back
    assert e.step() == [] and e.steps == [] and e.num_waiting == 1


# -- stop conditions --------------------------------------------------------------------------------------
def test_eos_stops_unless_ignored():
    e = engine(script={"a": [5, EOS, 9], "b": [5, EOS, 9]})
    e.add_request([10, 11], greedy(), request_id="a")
    e.add_request([10, 11], greedy(max_tokens=3, ignore_eos=True), request_id="b")
    drain(e)
    a, b = e.requests["a"], e.requests["b"]
    assert a.output_token_ids == [5, EOS] and a.status is RequestStatus.FINISHED_STOPPED
    assert a.stop_reason is None
    assert b.output_token_ids == [5, EOS, 9] and b.status is RequestStatus.FINISHED_LENGTH


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    e = engine(script={"a": [5, 6, 7, 8]})
    e.add_request([10, 11], greedy(stop_token_ids=[7]), request_id="a")
    drain(e)
    a = e.requests["a"]
    assert a.output_token_ids == [5, 6, 7] and a.status is RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == 7


def test_the_earliest_of_several_stop_strings_wins_and_is_cut_from_the_text():
    e = engine(script={"a": ids("abxcdyef")}, tokenizer=True)
    e.add_request([10, 11], greedy(max_tokens=8, stop=["y", "x"]), request_id="a")
    drain(e)
    a = e.requests["a"]
    assert a.output_text == "ab" and a.stop_reason == "x"       # "x" comes first in the text
    assert a.output_token_ids == ids("abx") and a.status is RequestStatus.FINISHED_STOPPED


def test_when_two_stop_strings_complete_at_once_the_earlier_position_wins():
    e = engine(script={"a": ids("qrstu")}, tokenizer=True)
    e.add_request([10, 11], greedy(stop=["s", "rs"]), request_id="a")
    drain(e)
    a = e.requests["a"]
    # Token "s" completes both: "rs" starts at 1, "s" at 2. The text ends before the earlier one.
    assert a.output_text == "q" and a.stop_reason == "rs"
    assert a.output_token_ids == ids("qrs")


def test_a_stop_string_at_the_very_start_of_the_output():
    e = engine(script={"a": ids("xyz")}, tokenizer=True)
    e.add_request([10, 11], greedy(stop=["x"]), request_id="a")
    drain(e)
    a = e.requests["a"]
    assert a.output_text == "" and a.stop_reason == "x" and a.output_token_ids == ids("x")


def test_a_token_holding_the_stop_twice_is_cut_at_the_first():
    e = engine(script={"a": ids("q") + [41, 12]}, tokenizer=True)      # "q", "xx", ...
    e.add_request([10, 11], greedy(stop=["x"]), request_id="a")
    drain(e)
    a = e.requests["a"]
    assert a.output_text == "q" and a.stop_reason == "x" and a.output_token_ids == [ids("q")[0], 41]


def test_two_stop_strings_at_the_same_position_the_first_listed_wins():
    for stops, reason in ((["rs", "r"], "rs"), (["r", "rs"], "r")):
        e = engine(script={"a": ids("q") + [40, 12]}, tokenizer=True)  # "q", "rs" in one token
        e.add_request([10, 11], greedy(stop=stops), request_id="a")
        drain(e)
        a = e.requests["a"]
        assert a.output_text == "q" and a.stop_reason == reason, (stops, a.stop_reason)


def test_a_stop_string_spanning_several_tokens():
    e = engine(script={"a": ids("qrstu")}, tokenizer=True)
    e.add_request([10, 11], greedy(stop=["rst"]), request_id="a")
    drain(e)
    a = e.requests["a"]
    assert a.output_text == "q" and a.stop_reason == "rst" and a.output_token_ids == ids("qrst")


def test_include_stop_str_in_output_keeps_the_whole_stop_string():
    # "abxcd" with stop "xc": found at 2 when "c" arrives; kept, the text ends after it: [:2 + 2].
    e = engine(script={"a": ids("abxcd"), "b": ids("abxcd")}, tokenizer=True)
    e.add_request([10, 11], greedy(stop=["xc"], include_stop_str_in_output=True), request_id="a")
    e.add_request([10, 11], greedy(stop=["xc"]), request_id="b")
    drain(e)
    a, b = e.requests["a"], e.requests["b"]
    assert a.output_text == "abxc" and a.stop_reason == "xc" and a.output_token_ids == ids("abxc")
    assert b.output_text == "ab" and b.stop_reason == "xc"


def test_a_stop_string_must_end_in_the_text_made_after_min_tokens():
    """As vLLM: while ``num_output_tokens <= min_tokens`` no stop string counts and the search
    start moves to the end of the text; after that a stop string counts only if it ends past
    that point (``stop_search_from``), so one made wholly before it is skipped."""
    # a: min_tokens=2, stop "x". "q" (1 token: no search, from=1), "x" (2: no search, from=2;
    # this "x" ends at 2, not past it), "y" (3 > 2: "qxy" searched from 2 - 1 + 1 = 2: none),
    # "x" (4: "qxyx" from 2: "x" at 3, ends at 4 > 2) -> text "qxy", 4 tokens.
    # b: min_tokens=2, stop "xy". "q", "x" (from=2), "y" (3: "qxy" searched from 2 - 2 + 1 = 1:
    # "xy" at 1 ends at 3 > 2, it spans the boundary and counts) -> text "q", 3 tokens.
    e = engine(script={"a": ids("qxyxz"), "b": ids("qxyz")}, tokenizer=True)
    e.add_request([10, 11], greedy(min_tokens=2, stop=["x"]), request_id="a")
    e.add_request([10, 11], greedy(min_tokens=2, stop=["xy"]), request_id="b")
    drain(e)
    a, b = e.requests["a"], e.requests["b"]
    assert a.output_text == "qxy" and a.stop_reason == "x", "a stop string made before min_tokens counted"
    assert a.output_token_ids == ids("qxyx") and a.status is RequestStatus.FINISHED_STOPPED
    assert b.output_text == "q" and b.stop_reason == "xy" and b.output_token_ids == ids("qxy")


def test_max_tokens_and_max_model_len_end_with_length():
    e = engine(max_model_len=8)
    e.add_request([10, 11, 12, 13], greedy(max_tokens=3), request_id="a")
    e.add_request([10, 11, 12, 13, 14, 15], greedy(max_tokens=10), request_id="b")
    drain(e)
    a, b = e.requests["a"], e.requests["b"]
    assert a.num_output_tokens == 3 and a.status is RequestStatus.FINISHED_LENGTH
    assert b.num_output_tokens == 2 and b.status is RequestStatus.FINISHED_LENGTH    # 6 + 2 = max_model_len


def test_a_finished_request_frees_its_blocks():
    e = engine(num_kv_blocks=8)
    e.add_request(list(range(10, 19)), greedy(max_tokens=4), request_id="a")
    e.step()
    assert e.kv.num_used_blocks == 3
    drain(e)
    assert e.kv.num_free_blocks == 8 and e.requests["a"].finish_time == 4 * STEP_S
    e.kv.check_invariants()


# -- events -------------------------------------------------------------------------------------------------
def test_events_of_a_request_in_order_with_schedule_only_once():
    events = []
    e = engine(events=events, num_kv_blocks=3, max_num_batched_tokens=8)
    e.add_request([10, 11, 12, 13], greedy(max_tokens=6), request_id="a", arrival_time=0.0)
    e.add_request([20, 21, 22, 23], greedy(max_tokens=6), request_id="b", arrival_time=0.0)
    drain(e)
    b = [ev for ev, _, rid in events if rid == "b"]
    assert b[:3] == ["arrival", "schedule", "first_token"] and b[-1] == "finish"
    assert b.count("schedule") == 1 and b.count("token") == 6
    assert "preempt" in b                                 # 3 blocks for 2 x 10 tokens: b is preempted
    assert e.requests["b"].num_preemptions == b.count("preempt")
    times = [t for ev, t, rid in events if rid == "b" and ev == "token"]
    assert times == sorted(times) and times == e.requests["b"].token_times


def test_abort_frees_the_blocks_once_and_emits_abort():
    events = []
    e = engine(events=events)
    rid = e.add_request([10, 11, 12, 13, 14], greedy(), request_id="a")
    e.step()
    assert e.kv.num_used_blocks == 2
    assert e.abort_request(rid) is True
    assert e.kv.num_used_blocks == 0 and e.requests[rid].status is RequestStatus.FINISHED_ABORTED
    assert e.abort_request(rid) is False and e.abort_request("nope") is False
    assert [ev for ev, _, r in events if r == rid][-1] == "abort"
    assert not e.has_unfinished_requests()


def test_reject_records_the_request_with_its_error_and_loses_nothing():
    events = []
    e = engine(events=events)
    r = e.reject([10, 11], greedy(), "too long", request_id="x", arrival_time=3.0)
    assert r.status is RequestStatus.REJECTED and r.error == "too long" and r.finish_time == 3.0
    assert r.prompt_token_ids == [10, 11] and r.prompt is None and r.request_id == "x"
    assert e.finished[-1] is r
    assert [(ev, t) for ev, t, rid in events] == [("arrival", 3.0), ("reject", 3.0)]
    text = e.reject("some text", greedy(), "no tokenizer")
    assert text.prompt == "some text" and text.prompt_token_ids == []
    assert text.arrival_time == e.clock.now() and text.request_id != "x"



def test_reject_keeps_the_given_sampling_params_and_replaces_anything_else():
    e = engine()
    sp = greedy(max_tokens=3)
    assert e.reject([10], sp, "too long", request_id="a").sampling_params is sp
    r = e.reject([10], {"max_tokens": -1}, "invalid sampling parameter", request_id="b")
    assert isinstance(r.sampling_params, SamplingParams)
    assert r.sampling_params.max_tokens == SamplingParams().max_tokens


def test_reject_of_params_made_bad_after_construction_records_the_request():
    """A seed set after construction (outside the int64 range) is what failed validation: reject
    must record the request with default params, not crash building its torch generator."""
    e = engine()
    sp = greedy(max_tokens=3)
    sp.seed = 2 ** 70
    r = e.reject([10], sp, "invalid seed", request_id="s")
    assert r.status is RequestStatus.REJECTED and r.error == "invalid seed"
    assert r.sampling_params.seed is None
    assert e.reject([10], greedy(max_tokens=3), "x", request_id="ok").sampling_params.max_tokens == 3


def test_reject_events_carry_the_prompt_length_and_the_error():
    seen = []
    e = engine()
    e.subscribe(lambda ev, t, r, info: seen.append((ev, t, r.request_id, dict(info))))
    e.reject([10, 11, 12], greedy(), "prompt too long", request_id="x", arrival_time=2.0)
    assert seen == [("arrival", 2.0, "x", {"prompt_len": 3}),
                    ("reject", 2.0, "x", {"error": "prompt too long"})]

def test_add_request_keeps_the_given_arrival_time_and_tenant_on_the_request_and_its_event():
    seen = []
    e = engine()
    e.subscribe(lambda ev, t, r, info: seen.append((ev, t, r.request_id, dict(info))))
    assert e.clock.now() == 0.0                     # the virtual clock has not moved: 2.5 is not "now"
    e.add_request([10, 11, 12], greedy(), request_id="a", arrival_time=2.5, priority=1, tenant="acme")
    req = e.requests["a"]
    assert req.arrival_time == 2.5 and req.tenant == "acme" and req.priority == 1
    assert seen == [("arrival", 2.5, "a", {"prompt_len": 3, "priority": 1, "tenant": "acme"})]


# -- validation ----------------------------------------------------------------------------------------------
# The whole message, as a user reads it (values worked out from each case: vocabulary 128,
# max_model_len 64, blocks of 4 tokens).
@pytest.mark.parametrize("prompt, params, cfg, message", [
    ([], greedy(), {}, "empty prompt: a request needs at least one token"),
    ([10, 200], greedy(), {}, "prompt token id 200 is outside the vocabulary [0, 128)"),
    ([10, -1], greedy(), {}, "prompt token id -1 is outside the vocabulary [0, 128)"),
    ([10, 128], greedy(), {}, "prompt token id 128 is outside the vocabulary [0, 128)"),   # one past the end
    ([0, 200], greedy(), {}, "prompt token id 200 is outside the vocabulary [0, 128)"),    # 0 is a token
    (list(range(10, 74)), greedy(), {},                                   # 64 tokens >= max_model_len 64
     "prompt of 64 tokens is too long: max_model_len is 64 (the prompt plus at least one generated token "
     "must fit)"),
    (list(range(10, 30)), greedy(), {"enable_chunked_prefill": False, "max_num_batched_tokens": 16},
     "prompt of 20 tokens exceeds max_num_batched_tokens=16 and chunked prefill is off"),
    (list(range(10, 24)), greedy(), {"enable_chunked_prefill": False, "max_batch_prefill_tokens": 12},
     "prompt of 14 tokens exceeds max_batch_prefill_tokens=12 and chunked prefill is off"),
    (list(range(10, 30)), greedy(max_tokens=20), {"max_batch_total_tokens": 30},     # 20 + 20 = 40 > 30
     "request needs 40 tokens (prompt + max_tokens) but max_batch_total_tokens is 30 (the most the tgi "
     "policy lets the batch hold)"),
    (list(range(10, 30)), greedy(max_tokens=20), {"num_kv_blocks": 9},   # 40 tokens: 10 blocks
     "request needs 10 KV blocks (40 tokens) but the whole cache has only 9; it can never be served"),
    ([10, 11.0], greedy(), {}, "a token-id prompt must be a list of integers"),
    (5, greedy(), {}, "a prompt must be a string or a list of token ids, got int"),
    ("text", greedy(), {}, "this model has no tokenizer; pass the prompt as a list of token ids"),
    ([10], {"max_tokens": 4}, {}, "sampling params must be a SamplingParams, got dict"),
])
def test_bad_requests_raise_and_queue_nothing(prompt, params, cfg, message):
    events = []
    e = engine(events=events, **cfg)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        e.add_request(prompt, params)
    assert e.requests == {} and events == [] and not e.has_unfinished_requests()


def test_an_empty_text_prompt_is_refused_before_tokenizing():
    e = engine(tokenizer=True)                       # Chars has no encode(): "" must not reach it
    with pytest.raises(ValueError, match=r"^empty prompt: a request needs at least one token$"):
        e.add_request("", greedy())
    assert e.requests == {}


def test_too_many_requests_in_flight_are_refused_with_the_limit_and_what_to_do():
    e = engine(max_inflight_requests=1)
    e.add_request([10], greedy())
    message = ("overloaded: max_inflight_requests=1 requests are already waiting or running; retry later "
               "(backpressure, TGI's max_concurrent_requests)")
    with pytest.raises(Overloaded, match=f"^{re.escape(message)}$"):
        e.add_request([11], greedy())
    assert e.num_waiting == 1


def test_the_edges_of_each_limit_are_accepted():
    e = engine()
    e.add_request([0, 127], greedy())                    # the first and the last id of 128
    e = engine(enable_chunked_prefill=False, max_num_batched_tokens=16)
    e.add_request(list(range(10, 26)), greedy())         # 16 tokens: the whole budget, unchunked
    assert e.num_waiting == 1
    e = engine(enable_chunked_prefill=False, max_batch_prefill_tokens=12)
    e.add_request(list(range(10, 22)), greedy())         # 12 tokens: the whole prefill budget
    e = engine(max_batch_total_tokens=30)
    e.add_request(list(range(10, 20)), greedy(max_tokens=20))    # 10 + 20 = 30 tokens: all of it
    assert e.num_waiting == 1


def test_a_request_that_just_fits_is_accepted():
    e = engine(num_kv_blocks=10)
    e.add_request(list(range(10, 30)), greedy(max_tokens=20))            # 40 tokens = 10 blocks exactly
    e = engine()
    e.add_request(list(range(10, 73)), greedy(max_tokens=1))             # 63 < max_model_len 64
    assert e.num_waiting == 1


def test_duplicate_request_ids_are_refused():
    e = engine()
    e.add_request([10], greedy(), request_id="a")
    with pytest.raises(ValueError, match=r"^duplicate request id 'a'$"):
        e.add_request([11], greedy(), request_id="a")
    assert e.num_waiting == 1


# -- a step that fails ---------------------------------------------------------------------------------
class Poisoned(Scripted):
    """A batch fails while it holds a poisoned request; each request alone runs as usual."""

    def __init__(self, poison, **kw):
        super().__init__(**kw)
        self.poison = set(poison)
        self.calls = 0

    def execute(self, batch, kv):
        self.calls += 1
        bad = [r.request_id for r, _ in batch.items if r.request_id in self.poison]
        if bad:
            raise OverflowError(f"poisoned row {bad[0]}")
        return super().execute(batch, kv)


def poisoned_engine(poison):
    ex = Poisoned(poison)
    return LLMEngine(EngineConfig.from_kwargs(block_size=4), clock="virtual", executor=ex), ex


def test_a_lone_request_whose_step_fails_is_aborted_with_its_error_in_one_call():
    e, ex = poisoned_engine({"p"})
    e.add_request([10, 11, 12], greedy(), request_id="p")
    touched = e.step()
    p = e.requests["p"]
    assert ex.calls == 1                                   # alone: no second try
    assert [r.request_id for r in touched] == ["p"] and p.status is RequestStatus.FINISHED_ABORTED
    assert p.error == "engine error in this request's step: OverflowError: poisoned row p"
    assert p.output_token_ids == [] and e.kv.num_used_blocks == 0
    assert e.steps[-1].duration == 0.0 and e.clock.now() == 0.0   # nothing was computed


def test_a_failing_request_in_a_batch_is_aborted_alone_and_the_others_step_as_usual():
    e, ex = poisoned_engine({"p"})
    for rid in ("p", "a", "b"):                            # the poisoned one first in the batch
        e.add_request([10, 11, 12], greedy(max_tokens=2), request_id=rid)
    touched = e.step()
    # One failed batch call, then one call per request: two healthy ones took a step each.
    assert ex.calls == 1 + 3
    assert e.requests["p"].status is RequestStatus.FINISHED_ABORTED and "poisoned row p" in e.requests["p"].error
    for rid in ("a", "b"):
        r = e.requests[rid]
        assert r.output_token_ids == [5] and r.num_computed_tokens == 3 and r.status is RequestStatus.RUNNING
    assert sorted(r.request_id for r in touched) == ["a", "b", "p"]
    step = e.steps[-1]
    assert (step.duration, step.forward_time) == (2 * STEP_S, 2 * STEP_S)   # the two runs that computed
    drain(e)
    assert [e.requests[r].output_token_ids for r in ("a", "b")] == [[5, 5], [5, 5]]
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_a_lone_failed_step_records_no_forward_time():
    e, _ = poisoned_engine({"p"})
    e.add_request([10, 11, 12], greedy(), request_id="p")
    e.step()
    step = e.steps[-1]
    assert (step.duration, step.forward_time) == (0.0, 0.0)   # the model never ran


# -- the length limit, from whatever the executor tells -------------------------------------------
class Bare:
    """An executor that says only how many KV blocks it has (and, if given, its max_model_len)."""

    def __init__(self, max_model_len=None, model_config=None):
        self.num_kv_blocks = 8
        if max_model_len is not None:
            self.max_model_len = max_model_len
        if model_config is not None:
            self.model_config = model_config

    def execute(self, batch, kv):
        raise AssertionError("not stepped in these tests")


def test_an_executor_without_a_model_config_gives_its_own_max_model_len():
    e = LLMEngine(EngineConfig.from_kwargs(block_size=4), clock="virtual", executor=Bare(max_model_len=32))
    assert e.max_model_len == 32 and e.eos_token_ids == () and e.vocab_size is None


def test_a_model_config_without_positions_and_no_executor_limit_takes_the_configured_one():
    mc = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=128, max_position_embeddings=None, sliding_window=None)
    e = LLMEngine(EngineConfig.from_kwargs(block_size=4, max_model_len=16), clock="virtual",
                  executor=Bare(model_config=mc))
    assert e.max_model_len == 16


def test_a_sliding_window_caps_the_model_length():
    mc = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=128, max_position_embeddings=64, sliding_window=16)
    e = LLMEngine(EngineConfig.from_kwargs(block_size=4), clock="virtual", executor=Bare(model_config=mc))
    assert e.max_model_len == 16                          # min(64 positions, a 16-token window)
    with pytest.raises(ValueError, match=r"max_model_len=32 exceeds what the model supports \(16\)"):
        LLMEngine(EngineConfig.from_kwargs(block_size=4, max_model_len=32), clock="virtual",
                  executor=Bare(model_config=mc))


def test_the_resolved_length_limit_reaches_the_config_and_the_scheduler():
    e = engine()                                          # no configured limit: the model's 64 positions
    assert e.max_model_len == 64 and e.config.max_model_len == 64 and e.kv.max_model_len == 64
    rid = e.add_request(list(range(10, 20)), greedy(max_tokens=100))
    assert e.scheduler.final_len(e.requests[rid]) == 64   # min(10 + 100, 64)


def test_output_text_is_decoded_per_token_only_when_streaming_or_stopping_on_text():
    e = engine(script={"a": ids("abc")}, tokenizer=True)
    e.add_request([10, 11], greedy(max_tokens=3), request_id="a")
    e.step()
    assert e.requests["a"].output_text == ""              # no stop strings, not streaming: decoded at the end
    drain(e)
    assert e.requests["a"].output_text == "abc"
    e = engine(script={"a": ids("abc")}, tokenizer=True)
    e.stream_text = True                                  # what serving.async_engine sets
    e.add_request([10, 11], greedy(max_tokens=3), request_id="a")
    e.step()
    assert e.requests["a"].output_text == "a"


def test_token_finish_and_abort_events_carry_the_token_and_the_reason():
    e = engine(script={"a": ids("ab"), "b": ids("xyz")})
    seen = []
    e.subscribe(lambda ev, t, r, info: seen.append((ev, r.request_id, dict(info))))
    e.add_request([3, 4], greedy(max_tokens=2), request_id="a")
    e.add_request([3, 4], greedy(stop_token_ids=[ids("y")[0]]), request_id="b")
    e.add_request([3, 4], greedy(), request_id="c")
    e.step()
    e.abort_request("c")
    drain(e)
    tokens = [(rid, info["token"]) for ev, rid, info in seen if ev == "token"]
    assert [t for rid, t in tokens if rid == "a"] == ids("ab")
    assert [t for rid, t in tokens if rid == "b"] == ids("xy")            # y is the stop token, emitted then stop
    ends = {rid: (ev, info["reason"]) for ev, rid, info in seen if ev in ("finish", "abort")}
    assert ends == {"a": ("finish", "length"), "b": ("finish", "stop"), "c": ("abort", "abort")}


class SpecialChars(Chars):
    """Chars, and EOS decodes to "</s>" unless special tokens are skipped (by default they are
    not, as in Hugging Face tokenizers' ``decode``)."""

    def decode(self, ids, skip_special_tokens=False):
        plain = Chars()
        return "".join(("" if skip_special_tokens else "</s>") if i == EOS else plain.decode([i]) for i in ids)


def test_the_final_text_skips_special_tokens_and_the_detokenizer_state_is_dropped():
    e = engine(script={"a": ids("ab") + [EOS] + ids("c")})
    e.tokenizer = SpecialChars()
    e.stream_text = True                                   # incremental detokenizing while the request runs
    e.add_request([3, 4], greedy(max_tokens=4, ignore_eos=True), request_id="a")
    drain(e)
    out = e.output("a")
    assert out.outputs[0].token_ids == ids("ab") + [EOS] + ids("c")
    assert out.outputs[0].text == "abc", "the full decode at finish skips special tokens"
    assert e._detok == {}, "a finished request's incremental detokenizer is dropped"


class BytePieces:
    """A SentencePiece-like tokenizer in miniature: ids 50 and 51 are the two bytes of "é" (byte
    fallback), 52 is the word-initial piece " w", EOS is "</s>". As in Hugging Face's decode, a
    special token that is kept splits the byte stream (each side decodes alone, so a split
    character shows U+FFFD) and a skipped one does not; the decoded text loses its leading space."""

    BYTES = {50: b"\xc3", 51: b"\xa9", 52: b" w"}

    def decode(self, ids, skip_special_tokens=False):
        parts, buf = [], b""
        for i in ids:
            if i == EOS:
                if not skip_special_tokens:
                    parts += [buf.decode("utf-8", "replace"), "</s>"]
                    buf = b""
                continue
            buf += self.BYTES[i]
        text = "".join(parts) + buf.decode("utf-8", "replace")
        return text[1:] if text.startswith(" ") else text


def test_the_final_text_keeps_special_tokens_when_asked_in_the_output_and_the_prompt_context():
    # a: skip_special_tokens=False keeps EOS's "</s>" in the text: "ab</s>c" (not "abc").
    e = engine(script={"a": ids("ab") + [EOS] + ids("c")})
    e.tokenizer = SpecialChars()
    e.add_request([3, 4], greedy(max_tokens=4, ignore_eos=True, skip_special_tokens=False), request_id="a")
    drain(e)
    assert e.output("a").outputs[0].text == "ab</s>c"
    # b: the prompt [50, EOS, 51] keeps EOS, so its decode "\ufffd</s>\ufffd" has U+FFFD: no prompt
    # context, and the output [52] decodes alone, losing its space: "w". Had the context been
    # chosen skipping EOS ("é", no U+FFFD), the output would read after it: " w".
    e = engine(script={"b": [52]})
    e.tokenizer = BytePieces()
    e.add_request([50, EOS, 51], greedy(max_tokens=1, skip_special_tokens=False), request_id="b")
    drain(e)
    assert e.output("b").outputs[0].text == "w"


def test_the_streamed_text_decodes_the_first_token_after_the_prompt():
    # Prompt [52] (" w"), outputs 52, 52, 52. The detokenizer is primed with the prompt's context
    # [52]: decode([52, 52]) = "w w" less decode([52]) = "w" leaves " w", the first token's space
    # kept (decoded alone it would be "w"). At the end the full decode agrees: " w w w".
    e = engine(script={"a": [52, 52, 52]})
    e.tokenizer = BytePieces()
    e.stream_text = True
    e.add_request([52], greedy(max_tokens=3), request_id="a")
    e.step()
    assert e.requests["a"].output_text == " w"
    drain(e)
    assert e.requests["a"].output_text == " w w w"


class WithLogprobs(Scripted):
    """Scripted, and every sampled row comes with logprobs (-0.5, [(token, -0.5)]), asked or not."""

    def execute(self, batch, kv):
        out = super().execute(batch, kv)
        out.logprobs = {r.request_id: (-0.5, [(t, -0.5)]) for r, t in out.sampled}
        return out


def test_only_a_request_that_asked_keeps_the_logprobs_of_its_tokens():
    ex = WithLogprobs(script={"a": [5, 6], "b": [5, 6]})
    e = LLMEngine(EngineConfig.from_kwargs(block_size=4), clock="virtual", executor=ex)
    e.add_request([10, 11], greedy(max_tokens=2, logprobs=1), request_id="a")
    e.add_request([10, 11], greedy(max_tokens=2), request_id="b")
    drain(e)
    assert e.requests["a"].output_logprobs == [(-0.5, [(5, -0.5)]), (-0.5, [(6, -0.5)])]
    assert e.requests["b"].output_logprobs == [], "logprobs kept for a request that did not ask"
    assert e.output("b").outputs[0].logprobs is None


def test_a_stop_token_wins_over_a_stop_string_the_same_token_completes():
    # "c" is a stop token and also completes the stop string "bc": the token is checked first,
    # so the request stops on the token, not on the string. As in vLLM, the stop token's own
    # text is left out (kept with include_stop_str_in_output).
    e = engine(script={"a": ids("abcd"), "b": ids("abcd")}, tokenizer=True)
    e.add_request([3, 4], greedy(stop_token_ids=[ids("c")[0]], stop=["bc"]), request_id="a")
    drain(e)
    req = e.finished[-1]
    assert req.stop_reason == ids("c")[0] and req.output_text == "ab"
    e.add_request([3, 4], greedy(stop_token_ids=[ids("c")[0]], stop=["bc"], include_stop_str_in_output=True),
                  request_id="b")
    drain(e)
    req = e.finished[-1]
    assert req.stop_reason == ids("c")[0] and req.output_text == "abc"


def test_steps_record_no_swapped_blocks_without_a_swapper():
    e = engine(script={"a": ids("ab")})                               # recompute preemption: no swapper
    e.add_request([3, 4, 5], greedy(max_tokens=2), request_id="a")
    drain(e)
    assert e.scheduler.swapper is None and e.steps
    assert all((s.num_swapped_out_blocks, s.num_swapped_in_blocks) == (0, 0) for s in e.steps)


def test_a_steps_swap_copy_time_is_added_to_its_duration():
    e = engine(script={"a": ids("ab")}, preemption_mode="swap")
    e.scheduler.swapper.take_time = lambda: 0.25               # copy seconds pending for this step
    e.add_request([3, 4, 5], greedy(max_tokens=2), request_id="a")
    e.step()
    assert e.clock.now() == STEP_S + 0.25 and e.steps[0].duration == STEP_S + 0.25


class FailsRow(Scripted):
    """Like the sampler's per-row isolation: the step runs, but request ``p``'s row fails."""

    def execute(self, batch, kv):
        out = super().execute(batch, kv)
        bad = [r for r, _ in batch.items if r.request_id == "p"]
        return StepOutput([(r, t) for r, t in out.sampled if r.request_id != "p"], out.duration, out.forward_time,
                          failed=[(r, "ValueError: bad row") for r in bad])


def test_a_failed_rows_tokens_are_not_counted_as_computed_and_steps_are_numbered():
    e = LLMEngine(EngineConfig.from_kwargs(block_size=4), clock="virtual", executor=FailsRow())
    for rid in ("p", "a"):
        e.add_request([10, 11, 12], greedy(max_tokens=2), request_id=rid)
    e.step()
    p, a = e.requests["p"], e.requests["a"]
    assert p.status is RequestStatus.FINISHED_ABORTED and p.error == "engine error in this request's step: ValueError: bad row"
    assert p.num_computed_tokens == 0, "the failed row's prompt was not computed"
    assert a.num_computed_tokens == 3 and a.output_token_ids == [5]
    drain(e)
    assert [s.step for s in e.steps] == list(range(len(e.steps))) and len(e.steps) == 2


def test_step_records_durations_and_the_split_of_prefill_and_decode_sequences():
    e = engine(script={"a": ids("abc"), "b": ids("xy")})
    e.add_request([3, 4, 5], greedy(max_tokens=3), request_id="a")
    e.step()                                                   # a's prefill alone
    e.add_request([6, 7], greedy(max_tokens=2), request_id="b")
    e.step()                                                   # a decodes, b prefills
    s0, s1 = e.steps
    assert (s0.start_time, s0.duration, s1.start_time, s1.duration) == (0.0, STEP_S, STEP_S, STEP_S)
    assert (s0.num_prefill_seqs, s0.num_decode_seqs) == (1, 0)
    assert (s1.num_prefill_seqs, s1.num_decode_seqs) == (1, 1)


def test_aborting_a_waiting_request_takes_it_out_and_tells_the_policy():
    e = engine(script={"a": ids("ab")}, max_num_seqs=1, enable_prefix_caching=True)
    finished = []
    e.scheduler.policy.on_finished = finished.append          # a policy hook sees the request itself
    e.add_request(list(range(3, 13)), greedy(max_tokens=2), request_id="a")   # 2 full blocks hashed
    e.add_request([3, 4], greedy(max_tokens=2), request_id="w")
    e.step()                                                   # a runs; w waits (max_num_seqs=1)
    assert "a" in e.kv.req_hashes
    w = e.requests["w"]
    assert w in e.scheduler.waiting and e.abort_request("w")
    assert w not in e.scheduler.waiting and finished == [w]
    assert "w" not in e.kv.req_hashes and "w" not in e.kv.req_blocks
    drain(e)
    assert [r.request_id for r in finished] == ["w", "a"]
    assert e.kv.req_hashes == {} and e.kv.req_blocks == {}, "freed requests leave no block table or hashes"


class CharsEncoding(Chars):
    """``Chars`` that also encodes, adding a BOS (id 1) unless asked not to (Hugging Face's flag)."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens in (True, False), "a bool, as Hugging Face tokenizers take it"
        return ([1] if add_special_tokens else []) + ids(text)


def test_a_text_prompt_is_encoded_without_special_tokens():
    e = engine()
    e.tokenizer = CharsEncoding()
    rid = e.add_request("cab", greedy())
    # The prompt's own tokens only (c, a, b -> 12, 10, 11): no BOS in front, the text kept.
    assert e.requests[rid].prompt_token_ids == [12, 10, 11] and e.requests[rid].prompt == "cab"


def test_a_request_without_params_or_priority_gets_the_defaults():
    events = []
    e = engine(events=events)
    e.subscribe(lambda ev, t, r, info: events.append(info))
    rid = e.add_request([10, 11])
    r = e.requests[rid]
    assert r.priority == 0 and r.tenant is None
    assert r.sampling_params.max_tokens == SamplingParams().max_tokens
    assert events[-1] == {"prompt_len": 2, "priority": 0, "tenant": None}
