"""Dashboards, headless: controls, live changes during a simulated run, errors, Compare."""

from __future__ import annotations

import time

import ipywidgets as W
import pytest

from minibatch.policies import available
from minibatch.sim import available_hardware, available_models
from minibatch.widgets import Compare, Dashboard
from minibatch.workload import presets, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")
PNG = b"\x89PNG\r\n\x1a\n"
JPEG = b"\xff\xd8\xff"


def _wait_for(cond, timeout=20.0):
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def _settled(read, quiet=0.3, timeout=20.0):
    """``read()`` once it has stopped changing for ``quiet`` seconds (a paused run)."""
    t0 = time.perf_counter()
    value, since = read(), time.perf_counter()
    while time.perf_counter() - since < quiet:
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("the value kept changing")
        time.sleep(0.02)
        now = read()
        if now != value:
            value, since = now, time.perf_counter()
    return value


def _other_policy(current: str) -> str | None:
    """A second policy that serves every request without batching windows, if registered."""
    names = [p for p in available() if p != current]
    for p in ("sjf", "priority", "fair", "mlfq", "lpm"):
        if p in names:
            return p
    return names[0] if names else None


def test_controls():
    d = Dashboard()
    c = d.controls
    for name in ("policy", "request_rate", "max_num_seqs", "max_wait_ms", "max_num_batched_tokens", "workload",
                 "executor", "model", "hardware", "speed", "num_requests"):
        assert isinstance(c[name], W.ValueWidget), name
    assert list(c["policy"].options) == available()
    assert set(presets) <= set(c["workload"].options)
    assert list(c["model"].options) == available_models()
    assert list(c["hardware"].options) == available_hardware()
    assert {v for _, v in c["executor"].options} == {"model", "sim"}
    assert 0.0 in [v for _, v in c["speed"].options]           # as fast as possible
    assert c["model"].disabled and c["hardware"].disabled      # only for the simulator
    c["executor"].value = "sim"
    assert not c["model"].disabled and c["num_requests"].value == 300
    assert isinstance(d.widget, W.VBox) and d.image in d.widget.children
    assert d.image.value[:3] == JPEG and d.image.format == "jpeg"
    assert hasattr(d, "_ipython_display_")
    # Engine keywords set the initial controls.
    d = Dashboard(policy=available()[-1], max_num_seqs=48, max_wait_ms=20, max_num_batched_tokens=1024, **SIM)
    assert (c := d.controls)["policy"].value == available()[-1]
    assert (c["max_num_seqs"].value, c["max_wait_ms"].value, c["max_num_batched_tokens"].value) == (48, 20, 1024)
    assert (c["executor"].value, c["model"].value, c["hardware"].value) == ("sim", "llama-2-7b", "a100-80g")


def test_live_changes_during_a_simulated_run():
    # 300 chat requests last ~64 s of virtual time; at 45x the run takes ~1.5 s of wall time.
    d = Dashboard(workload="chat", num_requests=300, request_rate=8.0, speed=45, **SIM)
    d.start()
    assert d.controls["workload"].disabled and d.controls["executor"].disabled    # setup locked
    _wait_for(lambda: d.live.data.now > 10.0)
    # Pause first, so the changes land at a virtual time that does not depend on how quickly
    # this thread gets the CPU back (at 45x, 0.4 s of wall-clock jitter would be 18 virtual s).
    d.pause()
    paused_at = _settled(lambda: d.live.data.now)
    other = _other_policy("continuous")
    if other is not None:
        d.controls["policy"].value = other                    # through the widget, as a user would
    else:
        d.set("policy", "continuous")                         # only one policy: re-set it
    d.controls["max_num_seqs"].value = 64
    d.resume()
    _wait_for(lambda: d.live.data.now > paused_at + 10.0)
    d.controls["speed"].value = 0.0                           # then as fast as possible
    result = d.wait(60)
    assert d.errors == []
    assert len(result.requests) == 300
    assert all(r.completed for r in result.requests)
    changes = {name: (t, v) for t, name, v in result.reconfigurations}
    assert changes["policy"][1] == (other or "continuous")
    assert changes["max_num_seqs"][1] == 64
    first_step = result.steps[0].start_time
    # Applied when the run resumed: at the time it paused (at most a step or an idle jump later).
    assert all(paused_at <= t <= paused_at + 2.0 and t > first_step for t, _ in changes.values())
    assert result.config["max_num_seqs"] == 64 and result.config["policy"] == (other or "continuous")
    if other is not None:                                     # steps after the change ran the new policy
        assert {s.policy for s in result.steps if s.start_time > changes["policy"][0]} == {other}
    # The plots saw the run and its changes; the final frame is an image; setup is unlocked.
    assert d.renders >= 3 and d.image.value[:3] == JPEG
    assert d.plot.num_marks == len(result.reconfigurations) == 2
    assert "300/300 finished" in d.status.value and "Output throughput" in d.summary.value
    assert not d.controls["workload"].disabled and not d.buttons["start"].disabled
    assert d.figure("timeline").axes and d.figure("kv_block_map").axes


def test_pause_resume_and_reset():
    d = Dashboard(workload="chat", num_requests=100, request_rate=8.0, speed=30, **SIM)
    d.start()
    _wait_for(lambda: d.live.data.now > 2.0)
    d.pause()
    time.sleep(0.15)
    frozen = d.live.data.version
    time.sleep(0.3)
    assert d.live.data.version == frozen and d.buttons["pause"].description == "Resume"
    d.resume()
    result = d.wait(60)
    assert all(r.completed for r in result.requests)
    d.reset()
    assert d.live is None and d.result is None and d.status.value == "ready"
    with pytest.raises(RuntimeError):
        d.wait(1)


def test_error_in_a_callback_is_shown_and_the_run_goes_on():
    d = Dashboard(workload="chat", num_requests=100, request_rate=8.0, speed=30, **SIM)
    d.start()
    _wait_for(lambda: d.live.data.now > 2.0)

    def broken(name, value):
        raise RuntimeError("boom from controller")
    d.live.set = broken
    d.controls["max_num_seqs"].value = 7
    assert any("boom from controller" in e for e in d.errors)
    assert "boom from controller" in d.error_area.widget.value
    result = d.wait(60)
    assert all(r.completed for r in result.requests)


def test_error_in_the_run_thread_is_shown():
    d = Dashboard(workload="chat", num_requests=20, speed=0, executor="sim", model="llama-2-70b", hardware="a10")
    d.start()
    with pytest.raises(RuntimeError, match="the run failed"):
        d.wait(30)
    _wait_for(lambda: d.errors)
    assert "Error" in d.error_area.widget.value and "70b" in d.error_area.widget.value.lower()
    assert not d.buttons["start"].disabled


def test_tiny_model_dashboard():
    wl = synthetic(6, rate=20, input_len=16, output_len=6, seed=1, name="w")
    d = Dashboard(wl, speed=0, max_num_seqs=4)
    assert d.controls["workload"].value == "(custom)" and d.controls["num_requests"].disabled
    d.start()
    result = d.wait(120)
    assert [r.output_len for r in result.requests] == [6] * 6
    assert result.config["executor"] == "model" and result.config["max_num_seqs"] == 4


def test_compare_two_configurations():
    cmp = Compare(a={"max_num_seqs": 256}, b={"max_num_seqs": 8}, workload="chat", num_requests=80,
                  request_rate=8.0, speed=0, **SIM)
    assert set(cmp.sides) == {"A", "B"} and cmp.sides["B"]["max_num_seqs"].value == 8
    cmp.start()
    results = cmp.wait(60)
    assert cmp.errors == []
    assert list(results) == ["A: continuous, max_num_seqs=256", "B: continuous, max_num_seqs=8"]
    for r in results.values():
        assert len(r.requests) == 80 and all(x.completed for x in r.requests)
    a, b = (r.summary() for r in results.values())
    assert b["ttft_p99"] > a["ttft_p99"]                      # 8 sequences queue much longer
    assert cmp.bars.value[:8] == PNG and all(img.value[:8] == PNG for img in cmp.cdfs.values())
    assert "B vs A" in cmp.table.value and "TTFT p99" in cmp.table.value
    assert all(img.value[:3] == JPEG for img in cmp.images.values())
