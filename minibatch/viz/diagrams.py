"""Drawn diagrams for the chapters: the request pipeline, block tables, one scheduler step.

They draw structure, not measurements: boxes and arrows with matplotlib, from the
engine's own objects where there are some (a block table, a scheduled batch).
"""

from __future__ import annotations

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from minibatch.viz._common import COLORS, new_figure


def _box(ax, x, y, w, h, text, color="#e8eef7", fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="0.3", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, a, b, text=None, color="0.25", style="-|>"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, color=color, lw=1))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.12, text, ha="center", fontsize=7, color="0.3")


def request_pipeline(figsize=(10, 3.6)):
    """The path of a request through the engine: arrivals, the waiting queue, the scheduler
    (policy order under max_num_seqs and the token budget, KV blocks from the KV manager),
    the executor (real model or cost model), the sampler, and back into the running queue."""
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    _box(ax, 0.0, 2.0, 1.5, 0.9, "requests arrive\n(Poisson, bursty,\ntraces)", "#f3f3f3")
    _box(ax, 2.0, 2.0, 1.6, 0.9, "waiting queue\nScheduler.waiting")
    _box(ax, 4.1, 1.8, 2.0, 1.3, "Scheduler.schedule\npolicy order\nmax_num_seqs,\nmax_num_batched_tokens", "#fde9d9")
    _box(ax, 6.6, 2.0, 1.5, 0.9, "ScheduledBatch\n(request, new tokens)")
    _box(ax, 8.6, 2.0, 1.6, 0.9, "executor\nmodel | cost model", "#e2f0d9")
    _box(ax, 8.6, 0.4, 1.6, 0.8, "sampler\nstop checks")
    _box(ax, 4.1, 0.2, 2.0, 0.9, "KVCacheManager\nblocks, block tables", "#ede2f6")
    _box(ax, 6.6, 0.3, 1.5, 0.8, "running queue\nScheduler.running")
    _box(ax, 0.2, 0.3, 1.5, 0.8, "finished:\nTTFT, TPOT, E2E", "#f3f3f3")
    _arrow(ax, (1.5, 2.45), (2.0, 2.45), "add_request")
    _arrow(ax, (3.6, 2.45), (4.1, 2.45))
    _arrow(ax, (6.1, 2.45), (6.6, 2.45))
    _arrow(ax, (8.1, 2.45), (8.6, 2.45), "one step")
    _arrow(ax, (9.4, 2.0), (9.4, 1.2), "logits")
    _arrow(ax, (8.6, 0.8), (8.1, 0.7), "token")
    _arrow(ax, (6.6, 0.9), (5.9, 1.8), "next step")
    _arrow(ax, (5.1, 1.8), (5.1, 1.1), "allocate / preempt", style="<|-|>")
    _arrow(ax, (6.6, 0.55), (6.1, 0.55), "free", style="-|>")
    _arrow(ax, (4.1, 0.6), (1.7, 0.7), "finish")
    ax.text(5.1, 3.35, "every step: finished requests leave, waiting ones join (iteration-level scheduling)",
            ha="center", fontsize=8, style="italic")
    ax.set_xlim(-0.1, 10.3)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    return fig


def block_tables(tables: dict[str, list[int]], num_tokens: dict[str, int], block_size: int, num_blocks: int,
                 figsize=(10, 3.8)):
    """Logical blocks of each request (left) and where they live in the pool (right): token
    ``t`` of a request is slot ``t % block_size`` of physical block ``table[t // block_size]``."""
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    cols = 8
    px0, py_top = 6.0, 3.2
    cw, ch = 0.5, 0.42
    colors = [f"C{i}" for i in range(10)]
    owner = {}
    for i, (rid, table) in enumerate(tables.items()):
        color = colors[i % len(colors)]
        y = py_top - i * 0.75
        ax.text(-0.1, y + 0.2, rid, ha="right", va="center", fontsize=9, color=color, weight="bold")
        for j, block in enumerate(table):
            filled = min(block_size, max(0, num_tokens[rid] - j * block_size))
            x = j * 0.85
            ax.add_patch(Rectangle((x, y), 0.75, 0.4, fc="white", ec=color, lw=1.2))
            ax.add_patch(Rectangle((x, y), 0.75 * filled / block_size, 0.4, fc=color, alpha=0.35, lw=0))
            ax.text(x + 0.375, y + 0.2, f"L{j}", ha="center", va="center", fontsize=7)
            owner[block] = (color, rid)
            bx, by = px0 + (block % cols) * cw, py_top - (block // cols) * ch
            ax.add_patch(FancyArrowPatch((x + 0.75, y + 0.2), (bx, by + ch / 2), arrowstyle="-|>",
                                         mutation_scale=7, color=color, lw=0.6, alpha=0.7,
                                         connectionstyle="arc3,rad=-0.1"))
    for b in range(num_blocks):
        bx, by = px0 + (b % cols) * cw, py_top - (b // cols) * ch
        color, _ = owner.get(b, ("white", None))
        ax.add_patch(Rectangle((bx, by), cw * 0.92, ch * 0.9, fc=color, alpha=0.45 if b in owner else 1,
                               ec="0.4", lw=0.6))
        ax.text(bx + cw * 0.46, by + ch * 0.45, str(b), ha="center", va="center", fontsize=6)
    ax.text(1.6, py_top + 0.65, "logical blocks (block table order)", ha="center", fontsize=9)
    ax.text(px0 + cols * cw / 2, py_top + 0.65, f"physical KV pool ({num_blocks} blocks x {block_size} slots)",
            ha="center", fontsize=9)
    rows = -(-num_blocks // cols)
    ax.set_xlim(-0.8, px0 + cols * cw + 0.2)
    ax.set_ylim(min(py_top - rows * ch, py_top - len(tables) * 0.75) - 0.2, py_top + 0.9)
    ax.axis("off")
    return fig


def scheduler_step(running: list[tuple[str, int]], waiting: list[tuple[str, int]], budget: int,
                   max_num_seqs: int, figsize=(10, 2.8)):
    """One scheduler step: walk the policy's order (running first, then waiting), give each
    request ``num_tokens - num_computed_tokens`` new tokens until the token budget or
    ``max_num_seqs`` runs out; the last prompt that does not fit is chunked."""
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    left, seqs = 0, 0
    narrow = []          # bars too thin for a label of their own (a decode's one token): named together
    for kind, items in (("decode", running), ("prefill", waiting)):
        for rid, need in items:
            if left >= budget or seqs >= max_num_seqs:
                ax.add_patch(Rectangle((left, -0.9), max(need, budget * 0.04), 0.5, fc="white", ec="0.5", ls="--"))
                ax.text(left + max(need, budget * 0.04) / 2, -0.65, f"{rid} waits", ha="center", va="center",
                        fontsize=7)
                left += max(need, budget * 0.04)
                continue
            take = min(need, budget - left)
            color = COLORS["decode"] if kind == "decode" else COLORS["prefill"]
            ax.add_patch(Rectangle((left, 0), take, 0.6, fc=color, ec="white", lw=0.8))
            if take < budget * 0.05:
                narrow.append((left + take / 2, rid, take))
            else:
                label = rid if take == need else f"{rid}: {take} of {need} (chunk)"
                ax.text(left + take / 2, 0.3, label, ha="center", va="center", fontsize=7)
            left += take
            seqs += 1
    if narrow:
        sizes = {t for _, _, t in narrow}
        each = f"{sizes.pop()} token each" if len(sizes) == 1 else "a few tokens each"
        x = sum(c for c, _, _ in narrow) / len(narrow)
        ax.annotate(f"{', '.join(r for _, r, _ in narrow)} ({each})", xy=(x, 0.6), xytext=(budget * 0.06, 0.8),
                    fontsize=7, va="center", arrowprops=dict(arrowstyle="-", color="0.3", lw=0.8))
    ax.axvline(budget, color="r", ls=":", lw=1.2)
    ax.text(budget, 0.8, f"max_num_batched_tokens = {budget} ", color="r", ha="right", va="center", fontsize=8)
    ax.set_title("running requests first, then waiting ones in policy order", fontsize=9)
    ax.set_xlim(0, max(left, budget) * 1.02)
    ax.set_ylim(-1.0, 1.0)
    ax.set_yticks([])
    ax.set_xlabel("new tokens computed in this step")
    return fig
