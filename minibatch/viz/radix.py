"""A radix tree drawn as a tree: one box per node, edges from parent to child.

Works for ``minibatch.radix.RadixTree`` (a node's label is the KV block ids on its edge)
and for any other tree whose nodes have a ``children`` dict (``label`` says what to
write in a box), such as the token-level tree of lab L08.
"""

from __future__ import annotations

from typing import Callable

from minibatch.viz._common import COLORS, new_figure


def _block_label(node) -> str:
    blocks = getattr(node, "blocks", None)
    if blocks is None:
        return str(len(getattr(node, "key", ())))
    shown = ",".join(map(str, blocks[:4])) + ("…" if len(blocks) > 4 else "")
    return f"[{shown}]"


def radix_tree(tree_or_root, label: Callable | None = None, figsize=(8, 3.5), title: str | None = None,
               highlight: Callable | None = None):
    """Figure of a radix tree: leaves spread left to right in depth-first order, each inner
    node centred over its children, the root on top.

    ``label(node) -> str`` (default: the node's block ids, or its key length);
    ``highlight(node) -> bool`` colours some nodes (for example the path a lookup walked).
    """
    root = getattr(tree_or_root, "root", tree_or_root)
    label = label or _block_label
    pos: dict[int, tuple[float, float]] = {}
    nodes, edges = [], []
    next_x = [0.0]

    def place(node, depth: int) -> float:
        kids = list(node.children.values())
        xs = [place(child, depth + 1) for child in kids]
        for child in kids:
            edges.append((id(node), id(child)))
        x = sum(xs) / len(xs) if xs else next_x[0]
        if not xs:
            next_x[0] += 1.0
        pos[id(node)] = (x, -depth)
        nodes.append(node)
        return x

    place(root, 0)
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    for a, b in edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.plot([x0, x1], [y0, y1], color="0.55", lw=1, zorder=1)
    for node in nodes:
        x, y = pos[id(node)]
        is_root = node is root
        face = COLORS["shared"] if highlight is not None and not is_root and highlight(node) else "white"
        ax.text(x, y, "root" if is_root else label(node), ha="center", va="center", fontsize=7, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", facecolor="#eeeeee" if is_root else face, edgecolor="0.3"))
    depth = max(-y for _, y in pos.values())
    ax.set(xlim=(-0.7, max(next_x[0] - 0.3, 0.7)), ylim=(-depth - 0.6, 0.6))
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9)
    return fig
