"""The KV block map: which request owns each block, and how full its last block is."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minibatch.viz._common import COLORS, new_figure

# Codes of the slot image: 0 free, 1 cached (free but hashed), 2 wasted slot, 3 shared block,
# 4.. owners (cycling through a qualitative palette).
_OWNER_COLORS = ["#4e79a7", "#f28e2b", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#bab0ac",
                 "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
_FIXED = [COLORS["free"], COLORS["cached"], COLORS["wasted"], COLORS["shared"]]


def kv_snapshot(engine) -> dict:
    """The KV block map of ``engine`` right now, as plain lists (JSON-friendly).

    Keys: ``time``, ``num_blocks``, ``block_size``, ``owner`` (per block: the first
    request holding it, or None), ``ref_cnt``, ``cached`` (has a prefix hash), ``filled``
    (slots holding computed tokens), ``requests`` ({request_id: [block ids]}).
    """
    kv = engine.kv
    bs = kv.block_size
    n = kv.num_blocks
    owner: list = [None] * n
    filled = [0] * n
    tables = {rid: list(blocks) for rid, blocks in kv.req_blocks.items()}
    for rid, blocks in tables.items():
        req = engine.requests.get(rid)
        computed = req.num_computed_tokens if req is not None else len(blocks) * bs
        for i, b in enumerate(blocks):
            if owner[b] is None:
                owner[b] = rid
            filled[b] = max(filled[b], min(bs, max(0, computed - i * bs)))
    pool = kv.pool.blocks
    return {"time": float(engine.clock.now()), "num_blocks": n, "block_size": bs, "owner": owner,
            "ref_cnt": [b.ref_cnt for b in pool], "cached": [b.block_hash is not None for b in pool],
            "filled": filled, "requests": tables}


def kv_block_map(engine_or_snapshot, columns: int | None = None, max_legend: int = 8, figsize=(8, 4)):
    """A grid of KV blocks coloured by owning request.

    Each block is a cell split into ``block_size`` slots: slots of a request's block in
    its colour, the unused slots of a request's last block as *wasted*, blocks held by
    several requests (prefix sharing) as *shared*, free blocks as *free* and free blocks
    that still hold a cached prefix as *cached*.
    """
    snap = engine_or_snapshot if isinstance(engine_or_snapshot, dict) else kv_snapshot(engine_or_snapshot)
    n, bs = snap["num_blocks"], snap["block_size"]
    cols = columns or max(1, min(64, math.ceil(math.sqrt(n * 2))))
    rows = math.ceil(n / cols)
    order = {rid: i for i, rid in enumerate(snap["requests"])}
    img = np.full((rows, cols * bs), np.nan)
    for b in range(n):
        r, c = divmod(b, cols)
        cells = img[r, c * bs:(c + 1) * bs]
        rid = snap["owner"][b]
        if rid is None:
            cells[:] = 1 if snap["cached"][b] else 0
        elif snap["ref_cnt"][b] > 1:
            cells[:] = 3
        else:
            cells[:] = 2
            cells[:snap["filled"][b]] = 4 + order[rid] % len(_OWNER_COLORS)
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    cmap = ListedColormap(_FIXED + _OWNER_COLORS).with_extremes(bad="white")
    ax.imshow(img, cmap=cmap, vmin=-0.5, vmax=len(_FIXED) + len(_OWNER_COLORS) - 0.5, aspect="auto",
              interpolation="nearest", extent=(0, cols, rows, 0))
    if n <= 1024:   # block borders
        ax.set_xticks(np.arange(cols + 1), minor=True)
        ax.set_yticks(np.arange(rows + 1), minor=True)
        ax.grid(which="minor", color="white", lw=0.8)
        ax.tick_params(which="minor", length=0)
    step = max(1, rows // 8)
    ax.set_yticks(np.arange(0, rows, step) + 0.5, [str(r * cols) for r in range(0, rows, step)])
    xstep = max(1, cols // 16)
    ax.set_xticks(np.arange(0, cols, xstep) + 0.5, [str(c) for c in range(0, cols, xstep)])
    ax.set_xlabel(f"block id offset in row (each block: {bs} slots)")
    ax.set_ylabel("first block id of row")
    used = sum(1 for o in snap["owner"] if o is not None)
    wasted = sum(bs - f for o, f in zip(snap["owner"], snap["filled"]) if o is not None)
    ax.set_title(f"KV blocks at t={snap['time']:.4g} s: {used}/{n} used by {len(snap['requests'])} requests, "
                 f"{wasted} wasted slots", fontsize=9)
    handles = [Patch(facecolor=c, edgecolor="0.6", label=lbl) for c, lbl in
               zip(_FIXED, ("free", "cached (free, hashed)", "wasted slots", "shared"))]
    for rid, i in list(order.items())[:max_legend]:
        handles.append(Patch(color=_OWNER_COLORS[i % len(_OWNER_COLORS)], label=str(rid)))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    return fig
