"""A cost model fitted to step times measured on the real engine.

The profiler (``python -m minibatch profile``) times real steps over a grid of batch
compositions and calls :meth:`FittedCostModel.fit`. The default model is::

    t = g(M)                                     # the weights' work for M tokens in the step
      + c_prefill_seqs * #prefill                # per prefill chunk: its own attention calls
      + c_prefill_attn * sum_i P_i               # causal attention pairs,
                                                 #   P = n*(c-n) + n*(n+1)/2
      + c_decode_ctx   * sum_j c_j               # reading each decode sequence's KV cache
      + c_num_seqs     * (#prefill + D)          # per-sequence work: sampling, bookkeeping
      + c_after_big    * recency                 # caches still cold after a big step

with M = sum_i n_i + D the step's tokens (prefill chunks of n_i new tokens and context
c_i after them, plus D decoding sequences of context c_j). ``g`` is piecewise linear
between knots at 1, 2, 4, ... tokens (features ``tokens@K``: "tent" functions that are 1
at K and fall to 0 at the neighbouring knots, so each coefficient is g at its knot). It
is fitted non-decreasing (more tokens never cost less) and is not a straight line
because a GEMM is not: on a CPU one token is a matrix-vector product that streams the
weights once, a few tokens cost nearly the same, and only past tens of tokens does the
time grow in proportion; on a GPU the same bend sits at
the compute/bandwidth ridge. Knots without enough samples near them are dropped, so
g interpolates across gaps rather than falling to 0; past the last knot g grows in
proportion to M.

The older linear model (``const + prefill_tokens + decode_seqs + ...``, all in
``FEATURES``) remains available by naming its features. Coefficients are fitted by
non-negative least squares (Lawson & Hanson, *Solving Least Squares Problems*, 1974,
ch. 23), so each stays a cost (>= 0), in seconds per unit. By default the fit minimises
*relative* error (a 5 ms decode step counts as much as a 500 ms prefill), weighting each sample by 1/(predicted t) through a few
rounds of reweighting rather than by its own measured 1/t, which would favour the
samples that happened to run fast and bias every prediction low.

Samples that carry a ``"segment"`` (the profiler tags each workload of each pass) get
a speed factor per segment, fitted jointly: the machine's speed drifts while it is
profiled, and a slow spell during one workload would otherwise be charged to the batch
shapes that workload happened to run. ``metadata["segment_slowdown"]`` reports them.

This is Vidur's approach (Agrawal et al., MLSys'24: profile the operators over token
counts, interpolate) reduced to one model of the whole step.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
from typing import Any, Callable, Iterable, Sequence

import numpy as np

Prefill = Sequence[tuple[int, int]]


def _attn_pairs(prefill: Prefill) -> float:
    return float(sum(n * (c - n) + n * (n + 1) / 2 for n, c in prefill))


#: Feature name -> function of (prefill, decode_context_lens).
FEATURES: dict[str, Callable[[Prefill, Sequence[int]], float]] = {
    "const": lambda p, d: 1.0,
    "prefill_tokens": lambda p, d: float(sum(n for n, _ in p)),
    "prefill_attn": lambda p, d: _attn_pairs(p),
    "decode_seqs": lambda p, d: float(len(d)),
    "decode_ctx": lambda p, d: float(sum(d)),
    "num_seqs": lambda p, d: float(len(p) + len(d)),
    "prefill_seqs": lambda p, d: float(len(p)),
    # Not a function of the step alone: the step's ``recency`` (see next_recency), which
    # feature_vector and step_time take as an argument.
    "after_big_step": lambda p, d: 0.0,
}

#: A step soon after a big one runs slower. Measured here on decode steps of 1-4
#: sequences: +20% the step right after a step of more than 32 tokens, +8% the next, no
#: difference by the fourth (the big step's working set has pushed the weights out of
#: the caches). ``recency`` counts earlier big steps, each weighted by RECENCY_DECAY per
#: step since: 1 right after one, 0.5 a step later, and so on.
BIG_STEP_TOKENS = 32
RECENCY_DECAY = 0.5


def next_recency(recency: float, prefill: Prefill, decode_context_lens: Sequence[int]) -> float:
    """The recency of the step after this one (this one of ``recency``, composition given)."""
    big = step_tokens(prefill, decode_context_lens) > BIG_STEP_TOKENS
    return RECENCY_DECAY * recency + (1.0 if big else 0.0)


#: ``python -m minibatch profile`` fits with ``outlier_ratio`` = this: steps more than 20%
#: slower than the first fit (with their segment's speed) predicts are dropped and the
#: model fitted again. The slow steps are this VM's transient spells, and the profile,
#: a string of short, varied workloads, catches more of them than the long runs it is
#: asked to predict: in three invocations of ``benchmarks/sim_fidelity.py`` the
#: simulator overpredicted the light workloads' latency by 5-15% and the saturated one
#: by 0-3%, both shrinking once 1-9% of the profile's steps were dropped (largest
#: |error| 7.3, 15.5, 11.9% -> 6.3, 6.9, 8.0%), and in two later invocations that played
#: no part in choosing the ratio, 15.2 -> 11.4% and 10.3 -> 7.1% (same measurements,
#: refitted both ways; ``sim_fidelity.py --save-data``).
PROFILE_OUTLIER_RATIO = 1.2

#: The straight-line model: a constant plus per-token and per-sequence terms.
LINEAR_FEATURES = ("const", "prefill_tokens", "prefill_attn", "decode_seqs", "decode_ctx", "num_seqs")
#: Added to the ``tokens@K`` knots in the default model.
DEFAULT_EXTRA_FEATURES = ("prefill_seqs", "prefill_attn", "decode_ctx", "num_seqs")
TENT = "tokens@"


def _is_tent(name: str) -> bool:
    return name.startswith(TENT) and name[len(TENT):].isdigit() and int(name[len(TENT):]) > 0


def _check_features(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in FEATURES and not _is_tent(n)]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; known: {list(FEATURES)} and {TENT}K for K >= 1")


def step_tokens(prefill: Prefill, decode_context_lens: Sequence[int]) -> int:
    return sum(n for n, _ in prefill) + len(decode_context_lens)


def tent_values(m: float, knots: Sequence[int]) -> list[float]:
    """Piecewise-linear basis: weights on ``knots`` (ascending) that interpolate at ``m``."""
    out = [0.0] * len(knots)
    if m <= 0 or not knots:
        return out
    if m <= knots[0]:
        out[0] = m / knots[0]
    elif m >= knots[-1]:
        out[-1] = m / knots[-1]
    else:
        i = next(j for j in range(1, len(knots)) if m <= knots[j])
        lo, hi = knots[i - 1], knots[i]
        out[i - 1], out[i] = (hi - m) / (hi - lo), (m - lo) / (hi - lo)
    return out


def auto_knots(token_counts: Iterable[int], min_support: int = 3) -> list[int]:
    """Knots at 1, 2, 4, ... up to the largest count seen (and at it), keeping those with at
    least ``min_support`` samples between their neighbouring candidates."""
    counts = np.asarray(list(token_counts))
    top = int(counts.max())
    cands = [1 << i for i in range(top.bit_length()) if (1 << i) <= top]
    if cands[-1] != top:
        cands.append(top)
    keep = []
    for i, k in enumerate(cands):
        lo = cands[i - 1] if i else 0
        hi = cands[i + 1] if i + 1 < len(cands) else np.inf
        if ((counts > lo) & (counts < hi)).sum() >= min_support or (i == len(cands) - 1 and not keep):
            keep.append(k)
    return keep


def default_features(samples: Iterable[dict]) -> tuple[str, ...]:
    samples = list(samples)
    counts = [step_tokens(s.get("prefill", ()), s.get("decode", ())) for s in samples]
    extra = ("after_big_step",) if samples and all("recency" in s for s in samples) else ()
    return tuple(f"{TENT}{k}" for k in auto_knots(counts)) + DEFAULT_EXTRA_FEATURES + extra


def feature_vector(prefill: Prefill, decode_context_lens: Sequence[int],
                   names: Sequence[str] = LINEAR_FEATURES, recency: float = 0.0) -> np.ndarray:
    """The features of one step, in the order of ``names``."""
    knots = sorted(int(n[len(TENT):]) for n in names if _is_tent(n))
    tents = dict(zip(knots, tent_values(step_tokens(prefill, decode_context_lens), knots))) if knots else {}
    return np.array([tents[int(n[len(TENT):])] if _is_tent(n)
                     else recency if n == "after_big_step"
                     else FEATURES[n](prefill, decode_context_lens) for n in names])


def nnls(A: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """``argmin ||A x - b||_2`` subject to ``x >= 0`` (Lawson-Hanson active set).

    Columns are scaled to unit norm first so that ``tol`` is scale-free; all-zero
    columns get coefficient 0.
    """
    A, b = np.asarray(A, float), np.asarray(b, float)
    norms = np.linalg.norm(A, axis=0)
    live = norms > 0
    As = np.zeros_like(A)
    As[:, live] = A[:, live] / norms[live]
    n = A.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(3 * n + 10):
        w = As.T @ (b - As @ x)
        candidates = ~passive & live
        if not candidates.any() or w[candidates].max() <= tol * max(1.0, np.linalg.norm(b)):
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    out = np.zeros(n)
    out[live] = x[live] / norms[live]
    return out


def _environment() -> dict[str, Any]:
    meta: dict[str, Any] = {"machine": platform.machine(), "processor": platform.processor(),
                            "platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "python": platform.python_version(), "numpy": np.__version__}
    try:
        meta["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    meta["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return meta


def _solve(X: np.ndarray, y: np.ndarray, features: Sequence[str], weighting: str) -> np.ndarray:
    """Coefficients for ``X c ~ y``: all >= 0, g non-decreasing over its knots."""
    # g must not fall as tokens grow: fit its increments between knots (each >= 0)
    # instead of its values, i.e. columns summed from each knot upwards.
    tents = sorted((int(f[len(TENT):]), i) for i, f in enumerate(features) if _is_tent(f))
    order = [i for _, i in tents]
    U = np.eye(len(features))
    for a, i in enumerate(order):
        U[i, order[:a + 1]] = 1.0          # g_i = sum of the increments up to knot i
    Xc = X @ U
    if weighting == "absolute":
        return U @ nnls(Xc, y)
    # Relative error, without the downward bias of weighting each row by its own (noisy)
    # 1/t: start there, then reweight by 1/prediction a few times (iteratively
    # reweighted least squares), which estimates the *mean* step time of each
    # composition, what a simulated clock must add up.
    inc = nnls(Xc / y[:, None], np.ones_like(y))
    for _ in range(3):
        pred = np.maximum(Xc @ inc, 1e-3 * y.min())
        inc = nnls(Xc / pred[:, None], y / pred)
    return U @ inc


class FittedCostModel:
    """``t = sum_k coef_k * feature_k(batch)`` with coefficients fitted to measured steps."""

    KIND = "minibatch.FittedCostModel"

    def __init__(self, coefficients: dict[str, float], *, r2: float | None = None,
                 mean_rel_error: float | None = None, max_rel_error: float | None = None,
                 num_samples: int = 0, metadata: dict[str, Any] | None = None):
        _check_features(list(coefficients))
        self.feature_names = tuple(coefficients)
        self.coef = np.array([float(coefficients[n]) for n in self.feature_names])
        self.r2, self.mean_rel_error, self.max_rel_error = r2, mean_rel_error, max_rel_error
        self.num_samples = num_samples
        self.metadata = dict(metadata or {})
        # For step_time (called once per simulated step): knots parsed once, g's values
        # at them, and the other terms as (function, coefficient).
        tents = sorted((int(n[len(TENT):]), c) for n, c in zip(self.feature_names, self.coef) if _is_tent(n))
        self._knots = [k for k, _ in tents]
        self._g = [c for _, c in tents]
        self._terms = [(FEATURES[n], c) for n, c in zip(self.feature_names, self.coef)
                       if not _is_tent(n) and n != "after_big_step"]
        self._recency_coef = self.coefficients.get("after_big_step", 0.0)

    @property
    def coefficients(self) -> dict[str, float]:
        return dict(zip(self.feature_names, self.coef.tolist()))

    # -- fitting -------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[dict], features: Sequence[str] | None = None,
            weighting: str = "relative", metadata: dict[str, Any] | None = None,
            outlier_ratio: float | None = None) -> "FittedCostModel":
        """Fit to ``samples``: dicts ``{"prefill": [(new, ctx), ...], "decode": [ctx, ...],
        "time_s": seconds}``. ``features``: None for the default (``tokens@K`` knots placed
        by :func:`auto_knots` plus attention and per-sequence terms), ``LINEAR_FEATURES``
        for the straight-line model, or any list of names. ``weighting``: ``"relative"``
        (rows scaled by 1/predicted t) or ``"absolute"`` (plain least squares). ``metadata`` (model,
        device, ...) is stored with the machine, Python, numpy and torch versions.

        ``outlier_ratio``: if given, fit once, drop the samples that ran more than this
        many times slower than the fit (and their segment's speed factor) predicts, and
        fit again on the rest; ``metadata["outliers_dropped"]`` says how many. See
        :data:`PROFILE_OUTLIER_RATIO` for why the profiler does this."""
        if weighting not in ("relative", "absolute"):
            raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
        samples = list(samples)
        if not samples:
            raise ValueError("no samples to fit")
        if outlier_ratio is not None:
            if not outlier_ratio > 1.0:
                raise ValueError(f"outlier_ratio must be > 1, got {outlier_ratio!r}")
            first = cls.fit(samples, features, weighting)
            X, y = cls._design(samples, first.feature_names)
            speed = first.metadata.get("segment_slowdown", {})
            factor = np.array([speed.get(s.get("segment"), 1.0) for s in samples])
            keep = y <= outlier_ratio * factor * (X @ first.coef)
            kept = [s for s, k in zip(samples, keep) if k]
            if len(kept) < len(first.feature_names):
                kept = samples                    # too few left to fit: keep everything
            model = cls.fit(kept, first.feature_names, weighting, metadata)
            model.metadata.update(outlier_ratio=outlier_ratio, outliers_dropped=len(samples) - len(kept))
            return model
        features = tuple(features) if features is not None else default_features(samples)
        _check_features(features)
        X, y = cls._design(samples, features)
        if len(y) < len(features):
            raise ValueError(f"need at least {len(features)} samples to fit {len(features)} "
                             f"features, got {len(y)}")
        segments = [s.get("segment") for s in samples]
        speeds: dict[str, float] = {}
        if len(set(segments)) > 1 and None not in segments:
            # The machine's speed drifts while it is profiled (here by up to 1.5x for
            # seconds at a time). Give each segment (one workload of one pass) its own
            # speed factor, fitted jointly with the coefficients, so a slow spell during
            # one workload does not inflate the costs of the batch shapes it happened to
            # run; the coefficients describe the machine at its time-weighted mean speed.
            ids = {seg: i for i, seg in enumerate(dict.fromkeys(segments))}
            g = np.array([ids[seg] for seg in segments])
            factor = np.ones(len(ids))
            for _ in range(5):
                coef = _solve(X, y / factor[g], features, weighting)
                pred = X @ coef
                raw = np.bincount(g, y, len(ids)) / np.maximum(np.bincount(g, pred, len(ids)), 1e-12)
                factor = np.clip(raw * pred.sum() / y.sum(), 2 / 3, 3 / 2)    # mean 1, bounded
            coef = _solve(X, y / factor[g], features, weighting)
            coef *= y.sum() / (X @ coef).sum()          # predictions add up to the measured total
            pred = X @ coef
            slowdown = np.bincount(g, y, len(ids)) / np.maximum(np.bincount(g, pred, len(ids)), 1e-12)
            speeds = {seg: round(float(slowdown[i]), 3) for seg, i in ids.items()}
        else:
            coef = _solve(X, y, features, weighting)
        meta = {**_environment(), "weighting": weighting, **(metadata or {})}
        if speeds:
            meta["segment_slowdown"] = speeds      # measured / predicted time, per segment
        model = cls(dict(zip(features, coef.tolist())), num_samples=len(y), metadata=meta)
        model.r2, model.mean_rel_error, model.max_rel_error = model._scores(X, y)
        return model

    @staticmethod
    def _design(samples: Iterable[dict], features: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        rows, times = [], []
        for i, s in enumerate(samples):
            t = float(s["time_s"])
            if not np.isfinite(t) or t <= 0:
                raise ValueError(f"sample {i}: time_s must be a positive number, got {s['time_s']!r}")
            prefill = [(int(n), int(c)) for n, c in s.get("prefill", ())]
            rows.append(feature_vector(prefill, [int(c) for c in s.get("decode", ())], features,
                                       recency=float(s.get("recency", 0.0))))
            times.append(t)
        return np.array(rows).reshape(len(times), len(features)), np.array(times)

    def _scores(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
        pred = X @ self.coef
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        rel = np.abs(pred - y) / y
        return r2, float(rel.mean()), float(rel.max())

    def evaluate(self, samples: Iterable[dict]) -> dict[str, float]:
        """R^2 and mean/max relative error of this model on (held-out) ``samples``."""
        X, y = self._design(samples, self.feature_names)
        r2, mean_rel, max_rel = self._scores(X, y)
        return {"r2": r2, "mean_rel_error": mean_rel, "max_rel_error": max_rel, "num_samples": len(y)}

    # -- the CostModel interface ----------------------------------------------------------
    def step_time(self, prefill: Prefill, decode_context_lens: Sequence[int], recency: float = 0.0) -> float:
        """Seconds for one step (same arguments as :meth:`RooflineCostModel.step_time`, plus
        the step's ``recency`` for models with the ``after_big_step`` term)."""
        if not prefill and not decode_context_lens:
            return 0.0
        t = sum(f(prefill, decode_context_lens) * c for f, c in self._terms) + self._recency_coef * recency
        if self._knots:
            m = step_tokens(prefill, decode_context_lens)
            t += sum(w * g for w, g in zip(tent_values(m, self._knots), self._g))
        return float(t)

    def kv_capacity_tokens(self, *args, **kwargs) -> int | None:
        """Stored ``metadata["kv_capacity_tokens"]`` if the profiler recorded it, else None
        (a fit of step times knows nothing of memory; the engine's own budget applies)."""
        value = self.metadata.get("kv_capacity_tokens")
        return None if value is None else int(value)

    def describe(self) -> str:
        knots = [(n, c) for n, c in zip(self.feature_names, self.coef) if _is_tent(n)]
        terms = " + ".join(f"{c:.3g}*{n}" if n != "const" else f"{c:.3g}"
                           for n, c in zip(self.feature_names, self.coef) if not _is_tent(n))
        if knots:
            g = ", ".join(f"{n[len(TENT):]}: {c * 1e3:.3g}" for n, c in knots)
            terms = f"g(M) + {terms}\n  g(M) [ms] at M tokens = {{{g}}}"
        quality = (f"R^2={self.r2:.4f}, mean rel. error {self.mean_rel_error:.1%}, "
                   f"max {self.max_rel_error:.1%}" if self.r2 is not None else "not scored")
        what = ", ".join(f"{k}={self.metadata[k]}" for k in ("model", "device", "torch", "machine")
                         if k in self.metadata)
        return (f"FittedCostModel ({what}; {self.num_samples} samples, {quality})\n"
                f"  t[s] = {terms}")

    def __repr__(self) -> str:
        return f"FittedCostModel({self.coefficients!r})"

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.KIND, "version": 1, "units": "seconds",
                "features": list(self.feature_names), "coefficients": self.coefficients,
                "r2": self.r2, "mean_rel_error": self.mean_rel_error,
                "max_rel_error": self.max_rel_error, "num_samples": self.num_samples,
                "metadata": self.metadata}

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON: features, coefficients, fit quality and metadata."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=False)
            f.write("\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FittedCostModel":
        if data.get("kind") != cls.KIND:
            raise ValueError(f"not a saved FittedCostModel (kind={data.get('kind')!r})")
        coefs = data["coefficients"]
        return cls({n: coefs[n] for n in data["features"]}, r2=data.get("r2"),
                   mean_rel_error=data.get("mean_rel_error"), max_rel_error=data.get("max_rel_error"),
                   num_samples=data.get("num_samples", 0), metadata=data.get("metadata"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FittedCostModel":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))
