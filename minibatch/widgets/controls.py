"""The dashboard's controls (ipywidgets) and how they turn into a workload and engine options."""

from __future__ import annotations

import inspect
import json
import os

import ipywidgets as W

from minibatch.policies import available as available_policies
from minibatch.workload import Workload, load_workload, presets

# Knobs the running engine can change at its next step (see minibatch.runner.RECONFIGURABLE).
LIVE = ("policy", "request_rate", "max_num_seqs", "max_wait_ms", "max_num_batched_tokens")
# Knobs that define a run; they are locked while a run is in flight.
SETUP = ("workload", "num_requests", "executor", "model", "hardware")

SPEEDS = [("1x (real time)", 1.0), ("2x", 2.0), ("5x", 5.0), ("10x", 10.0), ("30x", 30.0), ("100x", 100.0),
          ("as fast as possible", 0.0)]
EXECUTORS = [("tiny model (CPU, real)", "model"), ("simulator", "sim")]
TOKEN_BUDGETS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
CUSTOM = "(custom)"
# The tiny model runs on CPU: presets are shrunk so a request fits in this many tokens.
TINY_MAX_LEN = 256
DEFAULT_REQUESTS = {"model": 40, "sim": 300}
DEFAULT_SPEED = {"model": 1.0, "sim": 10.0}
TINY_DEFAULT_RATE = 4.0

_STYLE = {"description_width": "initial"}


def _tiny_vocab_size() -> int:
    from minibatch import TINY_MODEL_PATH
    with open(os.path.join(TINY_MODEL_PATH, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def preset_rate(name: str) -> float:
    return float(inspect.signature(presets[name]).parameters["rate"].default)


def workload_rate(wl) -> float:
    t = sorted(s.arrival_time for s in wl)
    return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 1.0


def _sim_choices():
    from minibatch.sim import available_hardware, available_models
    return available_models(), available_hardware()


def build_controls(engine_kwargs: dict, *, workload=None, speed=None, num_requests=None,
                   request_rate=None, side: bool = False) -> dict:
    """All controls, initialised from the engine options; ``side`` builds only the per-config ones."""
    kw = engine_kwargs
    policies = available_policies()
    policy = kw.get("policy", kw.get("scheduling_policy", "continuous"))
    if policy not in policies:
        policies = policies + [policy]
    c: dict = {}
    c["policy"] = W.Dropdown(options=policies, value=policy, description="policy", style=_STYLE)
    seqs = int(kw.get("max_num_seqs", 256))
    c["max_num_seqs"] = W.IntSlider(value=seqs, min=1, max=max(512, seqs), description="max_num_seqs",
                                    style=_STYLE, continuous_update=False)
    c["max_wait_ms"] = W.FloatSlider(value=float(kw.get("max_wait_ms", 0.0)), min=0.0, max=500.0, step=5.0,
                                     description="max_wait_ms", style=_STYLE, continuous_update=False)
    budget = int(kw.get("max_num_batched_tokens", 2048))
    c["max_num_batched_tokens"] = W.SelectionSlider(options=sorted(set(TOKEN_BUDGETS) | {budget}), value=budget,
                                                    description="max_num_batched_tokens", style=_STYLE,
                                                    continuous_update=False)
    if side:
        return c
    executor = kw.get("executor", "model")
    models, hardware = _sim_choices()
    model = kw.get("model", "llama-2-7b") if executor == "sim" else "llama-2-7b"
    c["executor"] = W.ToggleButtons(options=EXECUTORS, value=executor, description="executor", style=_STYLE)
    c["model"] = W.Dropdown(options=models if model in models else models + [model], value=model,
                            description="model", style=_STYLE)
    hw = kw.get("hardware") or "a100-80g"
    c["hardware"] = W.Dropdown(options=hardware if hw in hardware else hardware + [hw], value=hw,
                               description="hardware", style=_STYLE)
    names = list(presets)
    if workload is None or isinstance(workload, str):
        wl_value = workload or "chat"
        rate = request_rate or (preset_rate(wl_value) if executor == "sim" else TINY_DEFAULT_RATE)
    else:
        names.append(CUSTOM)
        wl_value = CUSTOM
        rate = request_rate or workload_rate(workload)
    c["workload"] = W.Dropdown(options=names, value=wl_value, description="workload", style=_STYLE)
    n = num_requests or (len(workload) if wl_value == CUSTOM else DEFAULT_REQUESTS[executor])
    c["num_requests"] = W.BoundedIntText(value=n, min=1, max=1_000_000, description="requests", style=_STYLE,
                                         disabled=wl_value == CUSTOM, layout=W.Layout(width="160px"))
    c["request_rate"] = W.FloatLogSlider(value=rate, base=10, min=-1, max=2.5, step=0.05,
                                         description="request_rate (req/s)", style=_STYLE,
                                         continuous_update=False)
    sp = DEFAULT_SPEED[executor] if speed is None else float(speed or 0.0)
    options = SPEEDS if any(v == sp for _, v in SPEEDS) else SPEEDS + [(f"{sp:g}x", sp)]
    c["speed"] = W.Dropdown(options=options, value=sp, description="speed (virtual s / wall s)", style=_STYLE)
    sync_executor(c)
    return c


def sync_executor(c: dict) -> None:
    """Model and hardware choices only apply to the simulator."""
    sim = c["executor"].value == "sim"
    c["model"].disabled = not sim
    c["hardware"].disabled = not sim


def make_workload(c: dict, custom=None) -> Workload:
    """The workload the controls describe (presets shrunk to fit the chosen model)."""
    rate = float(c["request_rate"].value)
    if c["workload"].value == CUSTOM:
        wl = custom if isinstance(custom, Workload) else Workload(list(custom))
        if abs(workload_rate(wl) - rate) > 1e-6 * rate:
            wl = wl.with_rate(rate)
        return wl
    n = int(c["num_requests"].value)
    if c["executor"].value == "model":
        return load_workload(c["workload"].value, n=n, rate=rate, max_len=TINY_MAX_LEN,
                             vocab_size=_tiny_vocab_size() if c["workload"].value == "shared_prefix" else None)
    from minibatch.sim import get_model_spec
    max_len = get_model_spec(c["model"].value).max_model_len
    return load_workload(c["workload"].value, n=n, rate=rate, max_len=max_len)


def engine_options(c: dict, base: dict) -> dict:
    """Engine keywords: the fixed ones given to the dashboard, overridden by the controls."""
    kw = dict(base)
    kw.pop("scheduling_policy", None)
    for name in ("policy", "max_num_seqs", "max_wait_ms", "max_num_batched_tokens"):
        kw[name] = c[name].value
    kw["max_num_seqs"] = int(kw["max_num_seqs"])
    kw["max_num_batched_tokens"] = int(kw["max_num_batched_tokens"])
    kw["max_wait_ms"] = float(kw["max_wait_ms"])
    if "executor" in c:
        kw["executor"] = c["executor"].value
        if kw["executor"] == "sim":
            kw["model"] = c["model"].value
            kw["hardware"] = c["hardware"].value
        else:   # the real model: the one given to the dashboard, else the embedded tiny model
            kw["model"] = base.get("model", "tiny") if base.get("executor", "model") == "model" else "tiny"
            kw.pop("hardware", None)
    return kw


def validate_live(name: str, value):
    """Check a live change before it reaches the running engine (which would stop on a bad value)."""
    if name == "policy":
        if value not in available_policies():
            raise ValueError(f"unknown policy {value!r}; available: {available_policies()}")
        return value
    if name == "request_rate":
        value = float(value)
        if not value > 0:
            raise ValueError(f"request_rate must be > 0, got {value}")
        return value
    if name == "max_wait_ms":
        value = float(value)
        if value < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {value}")
        return value
    if name in ("max_num_seqs", "max_num_batched_tokens"):
        value = int(value)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        return value
    raise ValueError(f"{name!r} cannot change during a run; live knobs: {LIVE}")
