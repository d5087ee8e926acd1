"""SGLang's default step (``sglang`` policy): prefill-only steps while a prompt can run, decode-only otherwise."""

from __future__ import annotations

from minibatch import presets
from minibatch.runner import run
from minibatch.workload import RequestSpec, Workload, lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")


def _kinds(result):
    return [("prefill" if s.num_prefill_tokens else "") + ("decode" if s.num_decode_tokens else "")
            for s in result.steps]


def test_no_step_mixes_prefill_and_decode_and_continuous_does():
    wl = synthetic(60, 8.0, input_len=lognormal(median=400, sigma=0.8, max=3000), output_len=64, seed=3)
    kw = dict(max_num_seqs=32, max_num_batched_tokens=512, enable_chunked_prefill=True, **SIM)
    sg, cont = run(wl, policy="sglang", **kw), run(wl, policy="continuous", **kw)
    assert all(q.completed for q in sg.requests)
    assert "prefilldecode" not in _kinds(sg)
    assert {"prefill", "decode"} <= set(_kinds(sg))
    assert _kinds(cont).count("prefilldecode") > 10, "the comparison needs mixed steps under continuous"
    # Same tokens out, but decodes wait for prefills: a longer worst inter-token gap.
    assert sum(q.output_len for q in sg.requests) == sum(q.output_len for q in cont.requests)
    assert max(max(q.itl) for q in sg.requests if q.itl) > max(max(q.itl) for q in cont.requests if q.itl)


def test_a_chunked_prompt_holds_every_decode_until_its_last_chunk():
    # One decoding request, then a 2000-token prompt chunked 4 x 512: the decode waits 4 steps.
    wl = Workload([RequestSpec(0.0, 16, 40, request_id="short"), RequestSpec(0.2, 2000, 4, request_id="long")])
    res = run(wl, policy="sglang", max_num_seqs=8, max_num_batched_tokens=512, enable_chunked_prefill=True, **SIM)
    kinds = _kinds(res)
    first_long = next(i for i, s in enumerate(res.steps) if s.num_prefill_tokens >= 500)
    assert kinds[first_long:first_long + 4] == ["prefill"] * 4
    assert [s.num_prefill_tokens for s in res.steps[first_long:first_long + 4]] == [512, 512, 512, 464]
    assert kinds[first_long - 1] == "decode" and kinds[first_long + 4] == "decode"


def test_decodes_run_when_no_prompt_is_admitted_and_running_is_capped():
    # max_num_seqs=2: a third request waits (SGLang's max_running_requests) while the two decode.
    wl = Workload([RequestSpec(0.0, 32, 20, request_id=f"r{i}") for i in range(3)])
    res = run(wl, policy="sglang", max_num_seqs=2, max_num_batched_tokens=2048, **SIM)
    assert all(q.completed for q in res.requests)
    assert max(s.num_seqs for s in res.steps) <= 2
    third = next(q for q in res.requests if q.request_id == "r2")
    first_two_done = max(q.finish_time for q in res.requests if q.request_id != "r2")
    assert third.first_scheduled_time >= min(q.finish_time for q in res.requests if q.request_id != "r2")
    assert third.first_scheduled_time <= first_two_done


def test_the_sglang_preset_uses_it_and_cites_the_source():
    knobs = {k.name: k for k in presets.get("sglang").knobs}
    assert knobs["policy"].value == "sglang"
    assert "get_next_batch_to_run" in knobs["policy"].source and "enable_mixed_chunk = False" in knobs["policy"].source
    assert presets.get("sglang").version.startswith("v0.5.3")
