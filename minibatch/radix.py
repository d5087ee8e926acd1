"""A radix tree over cached KV blocks: the index behind SGLang's RadixAttention.

SGLang (Zheng et al., *SGLang: Efficient Execution of Structured Language Model
Programs*, NeurIPS'24) keeps every cached prefix in a radix tree: each edge is labelled
with a run of tokens, a node's children start with different tokens, and a request's
longest cached prefix is the path it can walk from the root. Here the tree is
block-granular (SGLang's ``page_size > 1``): an edge's label is a whole number of
blocks, ``key = tokens`` (``len(key) == len(blocks) * block_size``), and it carries
the ids of the KV blocks that hold those tokens.

::

    root ─ [sys prompt A: blocks 3,7,9] ─┬─ [question 1: block 12]
                                          └─ [question 2: blocks 4,5]
    root ─ [sys prompt B: block 8]

Three operations, each a walk from the root:

* :meth:`match_prefix` — the block ids of the longest cached prefix of a token list;
* :meth:`insert` — add a token list's blocks, splitting an edge where the new path
  leaves it (the split is what makes it a *radix* tree rather than a trie);
* :meth:`remove` — drop an evicted block and everything below it (a block's KV is only
  reachable through its prefix).

The engine feeds the tree from the hash-chained prefix cache of ``kv_cache.BlockPool``
(:meth:`add` with an explicit parent block, one block at a time), so both indexes
always agree; the ``lpm`` policy asks it how much of each waiting request is cached.
"""

from __future__ import annotations


class RadixNode:
    __slots__ = ("key", "blocks", "children", "parent")

    def __init__(self, key: tuple = (), blocks: list[int] | None = None, parent: "RadixNode | None" = None):
        self.key = tuple(key)                          # tokens on the edge into this node
        self.blocks = list(blocks or [])               # one block id per block_size tokens of key
        self.children: dict[tuple, RadixNode] = {}     # first block's tokens -> child
        self.parent = parent

    def __repr__(self) -> str:
        return f"RadixNode(blocks={self.blocks}, children={len(self.children)})"


class RadixTree:
    """Block-granular radix tree: token runs -> KV block ids."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = RadixNode()
        self._where: dict[int, RadixNode] = {}         # block id -> node whose edge holds it

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._where

    def _chunk(self, tokens, i: int) -> tuple:
        """Tokens of block ``i`` of a token sequence."""
        bs = self.block_size
        return tuple(tokens[i * bs:(i + 1) * bs])

    # -- lookup ----------------------------------------------------------------------
    def match_prefix(self, tokens, max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``tokens`` (whole blocks only)."""
        limit = len(tokens) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        bs = self.block_size
        node, out = self.root, []
        while len(out) < limit:
            child = node.children.get(self._chunk(tokens, len(out)))
            if child is None:
                break
            start, n = len(out) * bs, len(child.blocks)
            if len(out) + n <= limit and tuple(tokens[start:start + n * bs]) == child.key:
                out.extend(child.blocks)               # the whole edge matches (the common case)
                node = child
                continue
            for j, block in enumerate(child.blocks):
                if len(out) >= limit or self._chunk(child.key, j) != self._chunk(tokens, len(out)):
                    return out
                out.append(block)
            node = child
        return out

    # -- growth ----------------------------------------------------------------------
    def insert(self, tokens, blocks: list[int]) -> list[int]:
        """Index ``blocks`` as holding ``tokens`` (block ``i`` holds block ``i``'s tokens).

        The part of the path already in the tree keeps its blocks; the rest is added as one
        run (one edge grown or one new leaf, so inserting ``n`` blocks costs O(n), not the
        O(n^2) of adding them one at a time). Returns the block ids that were added.
        """
        have = self.match_prefix(tokens, max_blocks=len(blocks))
        added = list(blocks[len(have):])
        if added:
            bs = self.block_size
            self._attach(have[-1] if have else None, tuple(tokens[len(have) * bs:len(blocks) * bs]), added)
        return added

    def add(self, parent_block: int | None, tokens: tuple, block_id: int) -> None:
        """Add ``block_id`` (holding ``tokens``) right after ``parent_block`` (None: the root).

        If the parent ends a leaf edge the edge simply grows (path compression); if it
        sits inside an edge, the edge is split after it first.
        """
        self._attach(parent_block, tuple(tokens), [block_id])

    def _attach(self, parent_block: int | None, key: tuple, blocks: list[int]) -> None:
        """Hang the run ``blocks`` (holding ``key``, ``block_size`` tokens each) below ``parent_block``."""
        for b in blocks:
            if b in self._where:
                raise ValueError(f"block {b} is already in the radix tree")
        if parent_block is None:
            node = self.root
        else:
            node = self._where[parent_block]
            if node.blocks[-1] != parent_block:                   # inside the edge: split after it
                self._split(node, node.blocks.index(parent_block) + 1)
            if not node.children and node is not self.root:      # extend the leaf's edge
                node.key += key
                node.blocks += blocks
                for b in blocks:
                    self._where[b] = node
                return
        first = key[:self.block_size]
        if first in node.children:
            raise ValueError("that prefix is already cached under another block")
        leaf = RadixNode(key, blocks, node)
        node.children[first] = leaf
        for b in blocks:
            self._where[b] = leaf

    def _split(self, node: RadixNode, j: int) -> None:
        """Cut ``node``'s edge before its block ``j``: the tail becomes its only child."""
        bs = self.block_size
        tail = RadixNode(node.key[j * bs:], node.blocks[j:], node)
        tail.children = node.children
        for child in tail.children.values():
            child.parent = tail
        for b in tail.blocks:
            self._where[b] = tail
        node.key, node.blocks = node.key[:j * bs], node.blocks[:j]
        node.children = {tail.key[:bs]: tail}

    # -- eviction ----------------------------------------------------------------------
    def remove(self, block_id: int) -> list[int]:
        """Drop ``block_id`` and every block below it; return all the dropped ids."""
        node = self._where.get(block_id)
        if node is None:
            return []
        j = node.blocks.index(block_id)
        dropped = node.blocks[j:]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            dropped.extend(n.blocks)
            stack.extend(n.children.values())
        for b in dropped:
            del self._where[b]
        if j == 0:
            del node.parent.children[node.key[:self.block_size]]
            node.parent = None
        else:
            node.key, node.blocks = node.key[:j * self.block_size], node.blocks[:j]
            node.children = {}
        return dropped

    def check(self) -> None:
        """Structural invariants (tests): keys match block counts, the index matches the nodes."""
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert len(node.key) == len(node.blocks) * self.block_size
            for b in node.blocks:
                assert self._where[b] is node
            seen += len(node.blocks)
            for first, child in node.children.items():
                assert child.parent is node and child.key[:self.block_size] == first and child.blocks
                stack.append(child)
        assert seen == len(self._where)
