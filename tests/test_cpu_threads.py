"""Threads sized to the step (``minibatch.kernels.cpu_threads``, off by default): with
``ONE_THREAD_TOKENS`` set, a CPU step of at most that many tokens runs on one OpenMP
thread, larger steps on torch's count; the
setting is the calling thread's own and is restored after the step, and it changes no
greedy token. Behaviour only: how fast either way is measured by
``benchmarks/decode_sweep.py``, never here."""

from __future__ import annotations

import threading

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.kernels import cpu_threads
from minibatch.kernels.cpu_threads import step_threads, threads_for_step


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_rule():
    assert step_threads(1, 4, limit=8) == 1
    assert step_threads(8, 4, limit=8) == 1
    assert step_threads(9, 4, limit=8) == 4
    assert step_threads(1, 4, limit=0) == 4          # 0 turns it off
    assert step_threads(0, 4, limit=8) == 4          # an empty step changes nothing
    assert cpu_threads.ONE_THREAD_TOKENS == 0 and cpu_threads.step_threads(1, 4) == 4   # off by default


def test_set_for_the_body_and_restored(two_threads):
    with threads_for_step(1, limit=8) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError):
        with threads_for_step(1, limit=8):
            raise ValueError("a failing step")
    assert torch.get_num_threads() == 2               # restored on errors too
    with threads_for_step(100, limit=8) as n:
        assert n == 2 == torch.get_num_threads()


def test_only_the_calling_thread_changes(two_threads):
    """A server's engine thread on one thread leaves the main thread's count alone."""
    seen, inside, release = {}, threading.Event(), threading.Event()

    def engine_thread():
        with threads_for_step(1, limit=8):
            seen["engine"] = torch.get_num_threads()
            inside.set()
            release.wait(60)

    t = threading.Thread(target=engine_thread)
    t.start()
    assert inside.wait(60)
    seen["main"] = torch.get_num_threads()
    release.set()
    t.join(60)
    assert seen == {"engine": 1, "main": 2}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def _steps_threads(llm, monkeypatch, prompts, max_tokens):
    """(tokens in the step, OpenMP threads inside the model forward) for each step."""
    model = llm.engine.executor.model
    seen = []
    forward = model.forward

    def spy(input_ids, *args, **kwargs):
        seen.append((input_ids.numel(), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    monkeypatch.undo()
    return seen, [o.outputs[0].token_ids for o in outs]


def test_small_steps_run_on_one_thread(llm, two_threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "ONE_THREAD_TOKENS", 8)
    seen, _ = _steps_threads(llm, monkeypatch, [list(range(10, 50))], 4)
    assert set(seen) == {(40, 2), (1, 1)}, seen       # the prefill on two, each decode on one
    assert torch.get_num_threads() == 2


def test_turned_off_every_step_keeps_torch_count(llm, two_threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "ONE_THREAD_TOKENS", 0)
    seen, _ = _steps_threads(llm, monkeypatch, [list(range(10, 50))], 4)
    assert {n for _, n in seen} == {2}, seen


def test_greedy_tokens_do_not_depend_on_it(llm, two_threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "ONE_THREAD_TOKENS", 8)
    prompts = [list(range(10, 40)), list(range(200, 217)), [7, 300, 12, 900, 45]]
    on = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
          for p in prompts]                          # batch 1: every decode step on one thread
    monkeypatch.setattr(cpu_threads, "ONE_THREAD_TOKENS", 0)
    off = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
           for p in prompts]
    assert on == off
