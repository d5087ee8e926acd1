"""``minibatch.request``: a request's initial state, its token counters, its statuses, and the
``RequestOutput`` / ``RequestRecord`` built from it, on hand-made requests."""

from __future__ import annotations

import pytest
import torch

from minibatch.request import CompletionOutput, Request, RequestOutput, RequestStatus
from minibatch.results import RequestRecord
from minibatch.sampling_params import SamplingParams


def test_a_new_request_is_waiting_with_nothing_computed():
    sp = SamplingParams(max_tokens=4)
    prompt = [11, 12, 13]
    r = Request("r1", prompt, sp, 2.5)
    prompt.append(99)                                   # the request keeps its own copy
    assert r.request_id == "r1" and r.prompt_token_ids == [11, 12, 13] and r.sampling_params is sp
    assert r.arrival_time == 2.5 and r.status is RequestStatus.WAITING
    assert r.prompt is None and r.eos_token_ids == () and r.priority == 0 and r.tenant is None
    assert r.output_token_ids == [] and r.output_text == ""
    assert (r.num_computed_tokens, r.num_cached_tokens, r.num_preemptions) == (0, 0, 0)
    assert r.stop_reason is None and r.error is None
    assert r.first_scheduled_time is None and r.first_token_time is None and r.finish_time is None
    assert r.token_times == [] and r.generator is None and r.policy_state == {}


def test_request_keeps_its_optional_fields():
    r = Request("r2", [1], SamplingParams(), 0.0, eos_token_ids=(2, 3), priority=-1, tenant="t", prompt="hi")
    assert (r.eos_token_ids, r.priority, r.tenant, r.prompt) == ((2, 3), -1, "t", "hi")


def test_a_seeded_request_owns_a_generator_with_its_seed():
    r = Request("s", [1], SamplingParams(seed=1234), 0.0)
    assert isinstance(r.generator, torch.Generator) and r.generator.initial_seed() == 1234
    first = torch.rand(3, generator=r.generator)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    assert Request("z", [1], SamplingParams(seed=0), 0.0).generator.initial_seed() == 0


def test_token_counters_and_token_at():
    r = Request("c", [10, 11, 12], SamplingParams(), 0.0)
    r.output_token_ids += [20, 21]
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 2, 5)
    assert r.all_token_ids == [10, 11, 12, 20, 21]
    assert [r.token_at(i) for i in range(5)] == [10, 11, 12, 20, 21]    # i = 3 is the first output token
    r.all_token_ids.append(0)                                            # a new list, not the request's
    assert r.num_tokens == 5


@pytest.mark.parametrize("status, finished", [
    (RequestStatus.WAITING, False), (RequestStatus.RUNNING, False), (RequestStatus.SWAPPED, False),
    (RequestStatus.FINISHED_STOPPED, True), (RequestStatus.FINISHED_LENGTH, True),
    (RequestStatus.FINISHED_ABORTED, True), (RequestStatus.REJECTED, True),
])
def test_finished_statuses(status, finished):
    assert status.finished is finished
    r = Request("f", [1], SamplingParams(), 0.0)
    r.status = status
    assert r.is_finished is finished


def test_repr_names_the_request_and_its_counters():
    r = Request("q", [1, 2, 3, 4], SamplingParams(), 0.0)
    r.output_token_ids.append(5)
    r.num_computed_tokens = 4
    r.status = RequestStatus.RUNNING
    assert repr(r) == "Request('q', status=running, prompt=4, output=1, computed=4)"


def finished_request() -> Request:
    r = Request("o", [1, 2], SamplingParams(), 0.25, priority=2, tenant="t", prompt="ab")
    r.output_token_ids += [7, 8]
    r.output_text = "xy"
    r.status = RequestStatus.FINISHED_STOPPED
    r.stop_reason = "</s>"
    r.first_scheduled_time, r.first_token_time, r.finish_time = 0.5, 0.75, 1.5
    r.token_times = [0.75, 1.5]
    r.num_preemptions, r.num_cached_tokens = 1, 2
    return r


def test_request_output_of_a_finished_request():
    r = finished_request()
    out = RequestOutput.of(r)
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished, out.error) == ("o", "ab", [1, 2], True, None)
    assert out.outputs == [CompletionOutput(0, "xy", [7, 8], "stop", "</s>")]
    assert out.metrics == RequestRecord("o", 0.25, 2, 2, 2, "t", 0.5, 0.75, 1.5, [0.75, 1.5], 1, 2, "stop", None,
                                        None)                              # no token ids in the metrics
    r.output_token_ids.append(9)
    r.token_times.append(2.0)
    assert out.outputs[0].token_ids == [7, 8] and out.metrics.token_times == [0.75, 1.5]   # copies


def test_request_output_carries_logprobs_only_when_asked():
    # logprobs=1: one (log p of the sampled token, [(top id, log p)]) pair per output token, copied.
    r = Request("l", [1, 2], SamplingParams(logprobs=1), 0.0)
    r.output_token_ids += [7, 8]
    r.output_logprobs += [(-0.5, [(7, -0.5)]), (-0.25, [(8, -0.25)])]
    out = RequestOutput.of(r)
    assert out.outputs[0].logprobs == [(-0.5, [(7, -0.5)]), (-0.25, [(8, -0.25)])]
    r.output_logprobs.append((-1.0, [(9, -1.0)]))
    assert len(out.outputs[0].logprobs) == 2, "the output holds a copy"
    # logprobs=None (the default): none, even if the request held some.
    r = finished_request()
    r.output_logprobs.append((-0.5, [(7, -0.5)]))
    assert RequestOutput.of(r).outputs[0].logprobs is None


def test_request_output_of_a_running_and_of_a_rejected_request():
    r = Request("p", [1], SamplingParams(), 0.0)
    r.status = RequestStatus.RUNNING
    out = RequestOutput.of(r)
    assert not out.finished and out.outputs[0].finish_reason is None and out.metrics.finish_reason is None
    assert out.outputs[0].stop_reason is None and CompletionOutput(0, "", [], None).stop_reason is None
    r.status, r.error = RequestStatus.REJECTED, "too long"
    out = RequestOutput.of(r)
    assert out.finished and out.error == "too long" and out.outputs[0].finish_reason == "rejected"
    assert out.metrics.error == "too long" and out.metrics.finish_reason == "rejected"


def test_record_of_a_request_keeps_token_ids_unless_told_not_to():
    r = finished_request()
    assert RequestRecord.of(r).output_token_ids == [7, 8]
    assert RequestRecord.of(r, keep_tokens=False).output_token_ids is None
