"""Arrival processes: when requests arrive.

All functions return sorted arrival times in seconds, **the first at t = 0**,
then the cumulative sum of the gaps (so n arrivals use n - 1 gaps and the mean
rate ``(n-1)/duration`` is ``rate`` in expectation; unlike ``vllm bench serve``
we do not rescale so that the last request lands exactly at n/rate).

- ``gamma_arrivals``: independent gamma gaps with shape = ``burstiness`` and
  scale = 1/(rate*burstiness): mean gap 1/rate, CV 1/sqrt(burstiness). 1 is a
  Poisson process; < 1 is burstier, > 1 smoother (``vllm bench serve``'s
  ``--burstiness``). ``rate=inf`` puts every arrival at 0.
- ``onoff_arrivals``: bursts. ON periods (exponential length) with gamma gaps at
  ``rate_on``, separated by silent OFF periods (exponential length). This is how
  the Azure code trace looks: minutes of ~600 requests next to minutes of none.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["as_rng", "gamma_arrivals", "poisson_arrivals", "onoff_arrivals"]


def as_rng(seed) -> np.random.Generator:
    """A Generator from an int seed (or pass a Generator through)."""
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    return int(n)


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed=0) -> np.ndarray:
    """``n`` arrival times with gamma(shape=burstiness, scale=1/(rate*burstiness)) gaps."""
    n = _check_n(n)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    gaps = as_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def poisson_arrivals(n: int, rate: float, seed=0) -> np.ndarray:
    """A Poisson process: exponential gaps (``gamma_arrivals`` with burstiness 1)."""
    return gamma_arrivals(n, rate, 1.0, seed)


def onoff_arrivals(n: int, rate_on: float, mean_on: float, mean_off: float,
                   burstiness_on: float = 1.0, seed=0) -> np.ndarray:
    """``n`` arrivals in ON/OFF bursts.

    ON periods last Exp(mean_on) seconds and carry gamma arrivals at ``rate_on``
    (with ``burstiness_on``); OFF periods last Exp(mean_off) seconds with no
    arrivals. The long-run mean rate is about
    ``rate_on * mean_on / (mean_on + mean_off)``.
    """
    n = _check_n(n)
    for name, v in (("rate_on", rate_on), ("mean_on", mean_on), ("mean_off", mean_off),
                    ("burstiness_on", burstiness_on)):
        if not (v > 0 and math.isfinite(v)) and not (name == "mean_off" and v == 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v}")
    rng = as_rng(seed)
    scale = 1.0 / (rate_on * burstiness_on)
    times: list[np.ndarray] = []
    have, t = 0, 0.0
    while have < n:
        end = t + rng.exponential(mean_on)
        # Draw gaps in chunks until this ON period is over.
        chunk = max(16, int(2 * rate_on * mean_on))
        while True:
            arr = t + np.cumsum(rng.gamma(burstiness_on, scale, size=chunk))
            inside = arr[arr < end]
            times.append(inside)
            have += inside.size
            if inside.size < chunk or have >= n:
                break
            t = float(arr[-1])
        t = end + (rng.exponential(mean_off) if mean_off > 0 else 0.0)
    out = np.concatenate(times)[:n]
    return out - out[0] if n else out
