"""What moving KV between the device pool and a host tier costs, against recomputing it.

A host tier (:mod:`minibatch.kv_offload`) keeps prefix blocks that the device pool evicted.
Bringing ``n`` blocks back costs a copy over the host link (PCIe)::

    t_load = n * block_bytes / host_link_bandwidth

``block_bytes = block_size * kv_bytes_per_token`` per GPU; with tensor parallelism every GPU
copies its own heads' share over its own link at the same time, so the per-GPU bytes count.
The default bandwidth, 25 GB/s per direction, is what a PCIe Gen4 x16 link (32 GB/s per
direction on paper) achieves for large pinned copies; ``minibatch.swap`` uses the same figure.

The alternative is to recompute the prefix. Inside a step the prefix's tokens join the
request's own prefill, so what recomputing costs is the *marginal* step time::

    t_recompute = step_time(prefill=[(p + m, p + m)]) - step_time(prefill=[(m, m)])

for a prefix of ``p`` tokens in front of ``m`` tokens that must be computed anyway. A step
whose GEMMs are memory-bound (fewer tokens than the GPU's ridge point, a few hundred on an
H100) reads the weights once whatever its width, so a short prefix rides along almost free,
while loading it still pays the link per byte: recomputing is then the cheaper way back.
:func:`recompute_time` and :func:`load_time` give both sides for a cost model.
"""

from __future__ import annotations

HOST_LINK_BYTES_PER_S = 25e9


def transfer_time(num_blocks: int, block_bytes: float, bandwidth: float = HOST_LINK_BYTES_PER_S) -> float:
    """Seconds to copy ``num_blocks`` KV blocks of ``block_bytes`` over a link of ``bandwidth`` bytes/s."""
    if num_blocks < 0 or block_bytes < 0 or not bandwidth > 0:
        raise ValueError(f"transfer_time needs num_blocks >= 0, block_bytes >= 0 and bandwidth > 0, got "
                         f"{num_blocks}, {block_bytes}, {bandwidth}")
    return num_blocks * block_bytes / bandwidth


def block_bytes(cost_model, block_size: int) -> int:
    """Bytes of one KV block on one GPU: ``block_size * kv_bytes_per_token_per_gpu`` (0 if unknown)."""
    return block_size * int(getattr(cost_model, "kv_bytes_per_token_per_gpu", 0) or 0)


def load_time(cost_model, num_tokens: int, bandwidth: float = HOST_LINK_BYTES_PER_S) -> float:
    """Seconds to bring ``num_tokens`` tokens of KV back from the host tier (one GPU's share)."""
    return transfer_time(num_tokens, cost_model.kv_bytes_per_token_per_gpu, bandwidth)


def recompute_time(cost_model, num_tokens: int, rest: int = 1) -> float:
    """Marginal seconds of recomputing a ``num_tokens`` prefix in front of ``rest`` tokens that the
    request computes anyway (at least its last prompt token), alone in its step."""
    if num_tokens < 0 or rest < 1:
        raise ValueError(f"recompute_time needs num_tokens >= 0 and rest >= 1, got {num_tokens}, {rest}")
    total = num_tokens + rest
    return cost_model.step_time([(total, total)], []) - cost_model.step_time([(rest, total)], [])


# -- how big a cache has to be: LRU stack distances of a trace's prefix blocks -------------------
def stack_distances(workload, max_prompt: int | None = None):
    """LRU stack distance of every prefix-block reference of a trace with ``hash_ids`` (Mooncake).

    Walk the requests in arrival order and their ``hash_ids`` in prompt order; a reference's
    distance is the number of *other* blocks referenced since the last reference to the same
    block (``inf`` the first time). An LRU cache of ``C`` blocks hits exactly the references
    with distance ``< C`` (Mattson et al., 1970), so one pass gives the hit rate of every
    cache size. Returns numpy arrays ``(arrival_time, tokens, distance)`` per reference
    (``tokens``: the block's prompt tokens, 512 but fewer for a prompt's last block);
    requests whose prompt is ``max_prompt`` tokens or longer are left out (an engine rejects them).
    """
    import numpy as np

    refs, times, tokens = [], [], []
    for r in workload:
        if not r.hash_ids or (max_prompt is not None and r.prompt_len >= max_prompt):
            continue
        for j, h in enumerate(r.hash_ids):
            refs.append(h)
            times.append(r.arrival_time)
            tokens.append(min(512, r.prompt_len - 512 * j))
    n = len(refs)
    tree = [0] * (n + 1)                 # Fenwick tree: 1 at each block's latest reference

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:
        s, i = 0, i + 1
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    dist = np.full(n, np.inf)
    for t, h in enumerate(refs):
        p = last.get(h)
        if p is not None:
            dist[t] = prefix(t - 1) - prefix(p)
            add(p, -1)
        last[h] = t
        add(t, 1)
    return np.array(times), np.array(tokens), dist


def lru_hit_rate(distances, capacity_tokens: float, t0: float = 0.0, t1: float = float("inf"),
                 block_tokens: int = 512) -> float:
    """Prompt-token hit rate of an LRU cache of ``capacity_tokens`` over the references arriving in
    ``[t0, t1)``, from :func:`stack_distances`."""
    times, tokens, dist = distances
    window = (times >= t0) & (times < t1)
    return float(tokens[window & (dist < capacity_tokens / block_tokens)].sum() / tokens[window].sum())
