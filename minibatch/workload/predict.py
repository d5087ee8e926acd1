"""Output-length predictors for length-aware scheduling (SJF), fitted on a trace.

A scheduler that ranks by remaining work (``minibatch.policies.sjf``) needs the output
length before the request has generated anything. Real servers do not know it; they
predict it. This module has the two predictors the course uses, both plain callables
``predictor(req) -> int`` that :class:`~minibatch.policies.sjf.SJFPolicy` accepts:

- :class:`BucketedLengthPredictor`: the simplest model that learns from a trace. Prompt
  lengths are cut into buckets at quantiles of the training prompts (equal-count buckets),
  and a request is predicted to generate a quantile (default: the median) of the outputs
  the training requests of its bucket generated. It sees only the prompt length, so it can
  learn a relation that is not monotone (Azure's conversation trace has one) but nothing
  about the prompt's text; published predictors read the text (a fine-tuned small model:
  *S^3*, Jin et al., NeurIPS'23, classifies into length buckets; Qiu et al. 2024 regress
  with a BERT proxy; Fu et al. 2024 learn only the ranking).
- :class:`NoisyOracle`: the true length times ``exp(sigma * z)``, ``z ~ N(0, 1)`` drawn once
  per request id, a predictor of controlled error for asking what a given error costs. It
  reads ``max_tokens``, which is the true output length when runs use ``ignore_eos=True``.

:func:`spearman` (rank correlation, ties averaged) and :func:`prediction_errors` say how good
a prediction is for ranking, which is what SJF uses it for.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

__all__ = ["BucketedLengthPredictor", "NoisyOracle", "prediction_errors", "spearman"]


class BucketedLengthPredictor:
    """Predict the output length from the prompt length: a quantile of the training outputs
    in the request's prompt-length bucket.

    ``edges`` are the buckets' upper bounds (exclusive, increasing); a prompt of length
    ``p`` falls in bucket ``searchsorted(edges, p, side="right")``, so there are
    ``len(edges) + 1`` buckets and ``values`` holds one prediction per bucket.
    """

    def __init__(self, edges: Sequence[float], values: Sequence[int]):
        edges = np.asarray(edges, dtype=float)
        values = np.asarray(values, dtype=int)
        if edges.ndim != 1 or np.any(np.diff(edges) <= 0):
            raise ValueError("edges must be a strictly increasing 1-D sequence")
        if len(values) != len(edges) + 1:
            raise ValueError(f"need len(edges) + 1 = {len(edges) + 1} values, got {len(values)}")
        if np.any(values < 1):
            raise ValueError("every predicted length must be >= 1")
        self.edges, self.values = edges, values

    @classmethod
    def fit(cls, prompt_lens, output_lens, num_buckets: int = 8,
            quantile: float = 0.5) -> BucketedLengthPredictor:
        """Buckets at the ``k / num_buckets`` quantiles of ``prompt_lens`` (repeated cut points
        merge, so a few buckets may be missing); each bucket predicts the ``quantile`` of its
        requests' ``output_lens``."""
        p = np.asarray(prompt_lens, dtype=float)
        o = np.asarray(output_lens, dtype=float)
        if p.shape != o.shape or p.ndim != 1 or len(p) == 0:
            raise ValueError("prompt_lens and output_lens must be equal-length, non-empty 1-D sequences")
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        if not 0 <= quantile <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        cuts = np.quantile(p, np.arange(1, num_buckets) / num_buckets) if num_buckets > 1 else []
        edges = np.unique(cuts)
        edges = edges[edges > p.min()]            # a cut at the minimum would leave bucket 0 empty
        bucket = np.searchsorted(edges, p, side="right")
        values = [max(1, round(float(np.quantile(o[bucket == b], quantile)))) for b in range(len(edges) + 1)]
        return cls(edges, values)

    @classmethod
    def fit_workload(cls, workload, **kwargs) -> BucketedLengthPredictor:
        """:meth:`fit` on a ``Workload``'s prompt lengths and output lengths (``max_tokens``)."""
        return cls.fit(workload.prompt_lens, workload.output_lens, **kwargs)

    def bucket(self, prompt_lens) -> np.ndarray:
        return np.searchsorted(self.edges, np.asarray(prompt_lens, dtype=float), side="right")

    def predict(self, prompt_lens) -> np.ndarray:
        """Predicted output lengths for an array of prompt lengths."""
        return self.values[self.bucket(prompt_lens)]

    def __call__(self, req) -> int:
        """The predictor interface of ``SJFPolicy``: a ``Request`` in, a length out."""
        return int(self.predict([req.num_prompt_tokens])[0])

    def __repr__(self) -> str:
        return f"BucketedLengthPredictor({len(self.values)} buckets)"


class NoisyOracle:
    """The true output length times ``exp(sigma * z)``, ``z ~ N(0, 1)`` fixed per request id
    and ``seed`` (the same request gets the same prediction in every run). ``sigma=0`` is the
    oracle itself. Reads ``req.sampling_params.max_tokens``: the true length only when the
    run uses ``ignore_eos=True`` (as minibatch's workload replays do)."""

    def __init__(self, sigma: float, seed: int = 0):
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma!r}")
        self.sigma, self.seed = float(sigma), int(seed)

    def factor(self, request_id: str) -> float:
        z = np.random.default_rng([self.seed, zlib.crc32(request_id.encode())]).standard_normal()
        return float(np.exp(self.sigma * z))

    def predict(self, request_id: str, true_len: int) -> int:
        return max(1, round(true_len * self.factor(request_id)))

    def __call__(self, req) -> int:
        return self.predict(req.request_id, req.sampling_params.max_tokens)

    def __repr__(self) -> str:
        return f"NoisyOracle(sigma={self.sigma})"


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=float)
    ranks[order] = np.arange(len(x), dtype=float)
    _, inverse = np.unique(x, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / np.bincount(inverse))[inverse]


def spearman(a, b) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (Pearson correlation of their ranks,
    ties averaged); 0.0 when either is constant (a constant prediction cannot rank)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError("need two equal-length 1-D sequences of at least 2 values")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else 0.0


def prediction_errors(predicted, true) -> dict:
    """How far predictions are from the truth: mean absolute error (tokens), median of
    ``|log(predicted / true)|`` (a factor: 1.0 is exact), and Spearman's rank correlation."""
    p, t = np.asarray(predicted, dtype=float), np.asarray(true, dtype=float)
    if np.any(p <= 0) or np.any(t <= 0):
        raise ValueError("lengths must be positive")
    return {"mae": float(np.mean(np.abs(p - t))),
            "median_factor": float(np.exp(np.median(np.abs(np.log(p / t))))),
            "spearman": spearman(p, t)}
