"""One small, hand-made tree per rule of ``minibatch.radix`` (block size 2 throughout).

Each case builds a tree by hand, asks one question and checks it against values worked
out here: the ``max_blocks`` cap of ``match_prefix``, edge splits that move children,
the errors of ``add``, membership, and the structural checker on corrupted trees.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.radix import RadixTree

# Tokens of six blocks of size 2: block i holds (2i + 1, 2i + 2).
SIX = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def one_edge() -> RadixTree:
    """root -- [1 2 | 3 4 | 5 6: blocks 10, 11, 12] (a single three-block edge)."""
    t = RadixTree(block_size=2)
    assert t.insert(SIX[:6], [10, 11, 12]) == [10, 11, 12]
    assert len(t.root.children) == 1
    return t


# -- match_prefix ---------------------------------------------------------------------------
def test_max_blocks_caps_a_match_inside_one_edge():
    """The tokens match the whole three-block edge, but the caller allows fewer blocks:
    the answer stops at the cap, never past it (the lpm policy and admission both pass
    (num_tokens - 1) // block_size so that one token is left to compute)."""
    t = one_edge()
    tokens = SIX[:6]
    assert t.match_prefix(tokens) == [10, 11, 12]
    assert t.match_prefix(tokens, max_blocks=3) == [10, 11, 12]
    assert t.match_prefix(tokens, max_blocks=2) == [10, 11], "a 2-block cap returned more than 2 blocks"
    assert t.match_prefix(tokens, max_blocks=1) == [10]
    assert t.match_prefix(tokens, max_blocks=0) == []
    # Longer tokens than the tree: the cap still counts from the root.
    assert t.match_prefix(SIX, max_blocks=2) == [10, 11]


def test_max_blocks_caps_a_match_across_two_edges():
    """root -- [1 2 | 3 4: 10, 11] -- [5 6 | 7 8: 12, 13]: a cap of 3 stops one block into
    the second edge, a cap of 2 exactly at the split."""
    t = RadixTree(2)
    t.insert(SIX[:8], [10, 11, 12, 13])
    t.insert([1, 2, 3, 4, 0, 0], [10, 11, 20])           # splits after block 11
    t.check()
    assert t.match_prefix(SIX[:8]) == [10, 11, 12, 13]
    assert t.match_prefix(SIX[:8], max_blocks=3) == [10, 11, 12]
    assert t.match_prefix(SIX[:8], max_blocks=2) == [10, 11]
    assert t.match_prefix([1, 2, 3, 4, 0, 0], max_blocks=2) == [10, 11]


def test_contains_and_len_follow_the_indexed_blocks():
    t = one_edge()
    assert 10 in t and 12 in t, "an indexed block is reported missing"
    assert 13 not in t and 0 not in t, "a block never added is reported present"
    assert len(t) == 3
    t.remove(11)                                          # drops 11 and 12 below it
    assert 10 in t and 11 not in t and 12 not in t and len(t) == 1


# -- add ------------------------------------------------------------------------------------
def test_adding_a_block_twice_is_refused_by_name():
    t = one_edge()
    with pytest.raises(ValueError, match="block 11 is already in the radix tree"):
        t.add(None, (7, 8), 11)


def test_adding_a_second_block_for_a_cached_prefix_is_refused():
    """(1, 2) is already cached under block 10: a second block for the same tokens below
    the root is refused, and so is one for (3, 4) below block 10 once 10 has two children."""
    t = one_edge()
    with pytest.raises(ValueError, match="that prefix is already cached under another block"):
        t.add(None, (1, 2), 99)
    t.add(10, (0, 0), 20)                                 # splits after 10: children (3, 4) and (0, 0)
    with pytest.raises(ValueError, match="that prefix is already cached under another block"):
        t.add(10, (3, 4), 98)
    t.check()
    assert 99 not in t and 98 not in t


def test_a_split_above_children_reparents_them_to_the_tail():
    """root -- [1 2 | 3 4: 10, 11] -+- [5 6: 12]
                                     +- [7 8: 22]
    Adding a child after block 10 cuts the edge between 10 and 11: the new tail [3 4: 11]
    takes both children, whose parent must now be the tail (remove walks up through it)."""
    t = RadixTree(2)
    t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    t.insert([1, 2, 3, 4, 7, 8], [10, 11, 22])            # first split: after block 11
    t.insert([1, 2, 9, 9], [10, 30])                      # second split: after block 10
    t.check()
    head = t.root.children[(1, 2)]
    assert head.blocks == [10] and set(head.children) == {(3, 4), (9, 9)}
    tail = head.children[(3, 4)]
    assert tail.blocks == [11] and set(tail.children) == {(5, 6), (7, 8)}
    assert all(child.parent is tail for child in tail.children.values()), "children kept their old parent"
    assert t.remove(12) == [12]                           # unlinks [5 6] from the tail
    assert set(tail.children) == {(7, 8)}
    assert t.match_prefix([1, 2, 3, 4, 7, 8]) == [10, 11, 22]
    assert t.match_prefix([1, 2, 3, 4, 5, 6]) == [10, 11]
    t.check()


# -- check ----------------------------------------------------------------------------------
def two_level() -> RadixTree:
    """root -- [1 2: 10] -+- [3 4: 11]
                          +- [5 6: 12]"""
    t = RadixTree(2)
    t.insert([1, 2, 3, 4], [10, 11])
    t.insert([1, 2, 5, 6], [10, 12])
    t.check()
    return t


def test_check_catches_a_child_with_the_wrong_parent():
    t = two_level()
    t.root.children[(1, 2)].children[(3, 4)].parent = t.root       # blocks and key still fine
    with pytest.raises(AssertionError):
        t.check()


def test_check_catches_a_child_filed_under_the_wrong_first_block():
    t = two_level()
    head = t.root.children[(1, 2)]
    head.children[(7, 8)] = head.children.pop((5, 6))      # its parent is still right
    with pytest.raises(AssertionError):
        t.check()


def test_check_catches_a_child_without_blocks():
    t = two_level()
    head = t.root.children[(1, 2)]
    empty = type(head)((), [], head)                      # key () and no blocks: lengths agree
    head.children[()] = empty
    with pytest.raises(AssertionError):
        t.check()


def test_a_second_block_for_a_cached_prefix_is_refused_with_exactly_that_message():
    t = one_edge()
    with pytest.raises(ValueError, match=r"^that prefix is already cached under another block$"):
        t.add(None, (1, 2), 99)


def _shape(t: RadixTree):
    """A tree as nested ``(key, blocks, {first: child})`` tuples, for comparing two trees."""
    def walk(n):
        return (n.key, tuple(n.blocks), tuple(sorted((k, walk(c)) for k, c in n.children.items())))
    return walk(t.root)


@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=12), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_insert_as_one_run_builds_the_tree_that_adding_block_by_block_builds(prompts):
    """``insert`` hangs the new blocks as one run; ``add`` one block at a time (the engine's
    feed) must give the same tree, the same answers and the same errors, edge splits included.
    Token values 0-2 over block size 2 make shared prefixes and mid-edge splits common."""
    runs, steps = RadixTree(block_size=2), RadixTree(block_size=2)
    next_id = 0
    for tokens in prompts:
        n = len(tokens) // 2
        blocks = list(range(next_id, next_id + n))
        next_id += n
        added = runs.insert(tokens, blocks)
        have = steps.match_prefix(tokens, max_blocks=n)
        parent = have[-1] if have else None
        for i in range(len(have), n):
            steps.add(parent, tuple(tokens[2 * i:2 * i + 2]), blocks[i])
            parent = blocks[i]
        assert added == blocks[len(have):], "insert returns exactly the blocks it added"
        runs.check()
        assert _shape(runs) == _shape(steps), f"trees differ after inserting {tokens}"
        for q in prompts:
            assert runs.match_prefix(q) == steps.match_prefix(q)
