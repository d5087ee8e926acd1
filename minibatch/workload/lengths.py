"""Token-length distributions for prompts and outputs.

A length distribution is any object with ``sample(n, rng) -> np.ndarray`` of
positive integers (dtype int64). Four are provided:

- ``fixed(n)``                      every request has exactly ``n`` tokens;
- ``uniform(lo, hi)``               integers uniform on ``[lo, hi]``, both ends included;
- ``lognormal(...)``                the usual shape of real prompt and output lengths;
- ``empirical(values)``             resample observed lengths (e.g. a trace's column).

``lognormal`` is parameterised by any two of ``mean``, ``median`` and ``sigma``, and
``mean``/``median`` always describe the lengths you actually get, that is after
rounding and clipping to ``[min, max]``::

    lognormal(median=37, sigma=1.0, max=512)     # "median about 37, capped at 512"
    lognormal(median=129, mean=211, max=1000)    # match a trace's published median and mean
    lognormal(200, 0.8, 2048)                    # positional form: mean, sigma, max

Every length is at least 1: an engine cannot serve an empty prompt, and a request
must generate at least one token.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = [
    "LengthDist", "Fixed", "Uniform", "LogNormal", "Empirical",
    "fixed", "uniform", "lognormal", "empirical", "as_length_dist",
]


@runtime_checkable
class LengthDist(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


def _check_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


class Fixed:
    """Every request gets exactly ``n`` tokens."""

    def __init__(self, n: int):
        self.n = _check_int("n", n)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.n, dtype=np.int64)

    def __repr__(self) -> str:
        return f"fixed({self.n})"


class Uniform:
    """Integers drawn uniformly from ``[lo, hi]`` (both ends included)."""

    def __init__(self, lo: int, hi: int):
        self.lo = _check_int("lo", lo)
        self.hi = _check_int("hi", hi)
        if self.hi < self.lo:
            raise ValueError(f"uniform: hi ({hi}) must be >= lo ({lo})")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)

    def __repr__(self) -> str:
        return f"uniform({self.lo}, {self.hi})"


def _phi(x: float) -> float:
    """Standard normal CDF."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _clipped_mean(median: float, sigma: float, lo: float, hi: float) -> float:
    """Mean of ``clip(X, lo, hi)`` for X lognormal with the given median and sigma.

    Closed form: lo*P(X<lo) + hi*P(X>hi) + the partial expectation of X on [lo, hi].
    (Rounding to integers is ignored; it moves the mean by well under one token.)
    """
    if sigma == 0:
        return min(max(median, lo), hi)
    mu = math.log(median)
    a = (math.log(lo) - mu) / sigma
    b = (math.log(hi) - mu) / sigma if math.isfinite(hi) else math.inf
    middle = median * math.exp(sigma * sigma / 2) * (_phi(b - sigma) - _phi(a - sigma))
    return lo * _phi(a) + (hi * (1 - _phi(b)) if math.isfinite(hi) else 0.0) + middle


def _solve_increasing(f, target: float, lo: float, hi: float, what: str) -> float:
    """Bisection for f(x) = target, with f increasing on [lo, hi]."""
    if not f(lo) <= target <= f(hi):
        raise ValueError(f"lognormal: cannot reach {what}")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class LogNormal:
    """Lognormal lengths, rounded to integers and clipped to ``[min, max]``.

    Give exactly two of ``mean``, ``median`` and ``sigma`` (sigma is the standard
    deviation of log-length). ``mean`` is the arithmetic mean of the clipped,
    rounded lengths (not the ``mu`` parameter and not the mean before clipping);
    ``median`` is the median length. When ``mean`` is given the missing parameter
    is solved for numerically, so ``lognormal(median=129, mean=211, max=1000)``
    draws lengths whose median is 129 and whose mean is 211.
    """

    def __init__(self, mean: float | None = None, sigma: float | None = None,
                 max: int | None = None, *, median: float | None = None, min: int = 1):
        given = [k for k, v in (("mean", mean), ("median", median), ("sigma", sigma)) if v is not None]
        if len(given) != 2:
            raise ValueError("lognormal: give exactly two of mean, median and sigma "
                             f"(got {', '.join(given) or 'none'})")
        self.min = _check_int("min", min)
        self.max = None if max is None else _check_int("max", max, low=self.min)
        hi = math.inf if self.max is None else float(self.max)
        lo = float(self.min)
        if sigma is not None and (not math.isfinite(sigma) or sigma < 0):
            raise ValueError(f"lognormal: sigma must be a finite number >= 0, got {sigma}")
        for k, v in (("mean", mean), ("median", median)):
            if v is not None and not (lo <= v <= hi):
                raise ValueError(f"lognormal: {k} {v} lies outside [min, max] = [{lo:g}, {hi:g}]")

        if mean is None:  # median and sigma: nothing to solve
            self.median, self.sigma = float(median), float(sigma)
        elif median is None:  # mean and sigma: the clipped mean grows with the median
            self.sigma = float(sigma)
            self.median = _solve_increasing(lambda m: _clipped_mean(m, self.sigma, lo, hi),
                                            mean, lo, hi if math.isfinite(hi) else mean,
                                            f"mean {mean} with sigma {sigma} in [{lo:g}, {hi:g}]")
        else:  # mean and median: the clipped mean grows with sigma up to a peak
            self.median = float(median)
            grid = np.linspace(0.0, 6.0, 601)
            means = [_clipped_mean(self.median, s, lo, hi) for s in grid]
            top = int(np.argmax(means))
            self.sigma = _solve_increasing(lambda s: _clipped_mean(self.median, s, lo, hi),
                                           mean, 0.0, float(grid[top]),
                                           f"mean {mean} with median {median} in [{lo:g}, {hi:g}]")

    @property
    def mean(self) -> float:
        """Expected length (after clipping)."""
        return _clipped_mean(self.median, self.sigma, float(self.min),
                             math.inf if self.max is None else float(self.max))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        x = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(n)))
        return np.clip(x, self.min, self.max if self.max is not None else np.inf).astype(np.int64)

    def __repr__(self) -> str:
        bounds = f", min={self.min}" if self.min != 1 else ""
        bounds += f", max={self.max}" if self.max is not None else ""
        return f"lognormal(median={self.median:.4g}, sigma={self.sigma:.4g}{bounds})"


class Empirical:
    """Resample (with replacement) from observed lengths, e.g. a trace's column."""

    def __init__(self, values: Sequence[int] | np.ndarray, name: str | None = None):
        arr = np.asarray(values)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("empirical: values must be a non-empty 1-D sequence")
        if not np.issubdtype(arr.dtype, np.integer):
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise ValueError("empirical: values must be integers")
        arr = arr.astype(np.int64)
        if arr.min() < 1:
            raise ValueError(f"empirical: lengths must be >= 1, got {arr.min()}")
        self.values = arr
        self.name = name

    @classmethod
    def from_csv(cls, path, column: str) -> "Empirical":
        """Lengths from one column of a CSV file with a header row, e.g.
        ``empirical.from_csv("sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "num_decode_tokens")``.
        Zero lengths are dropped."""
        import csv
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if column not in (reader.fieldnames or []):
                raise ValueError(f"{path}: no column {column!r} (has {reader.fieldnames})")
            vals = [int(float(row[column])) for row in reader]
        return cls([v for v in vals if v >= 1], name=f"{column} of {path}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(self.values, size=n, replace=True)

    def __repr__(self) -> str:
        what = self.name or f"{self.values.size} values"
        return f"empirical({what}, median={np.median(self.values):g})"


# Lower-case constructors: the names the rest of the project and the course use.
fixed = Fixed
uniform = Uniform
lognormal = LogNormal
empirical = Empirical


def as_length_dist(x) -> LengthDist:
    """An int means ``fixed(x)``; a distribution object passes through."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return Fixed(int(x))
    if hasattr(x, "sample"):
        return x
    raise TypeError(f"expected an int or a length distribution, got {x!r}")
