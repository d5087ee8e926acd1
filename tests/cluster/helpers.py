"""Shared helpers of the cluster tests: engines with a virtual clock, records compared field by field."""

from __future__ import annotations

import dataclasses

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from tests.conftest import FixedStepTime


def tiny_engine(step_s: float = 0.01, **kw) -> LLMEngine:
    """The embedded tiny model, every step lasting ``step_s`` of virtual time (deterministic)."""
    from minibatch.executor import ModelExecutor

    cfg = EngineConfig.from_kwargs(executor="model", model="tiny", **kw)
    return LLMEngine(cfg, clock="virtual", executor=FixedStepTime(ModelExecutor(cfg), step_s))


def record_dicts(records, drop=("replica", "model")):
    return [{k: v for k, v in dataclasses.asdict(r).items() if k not in drop} for r in records]
