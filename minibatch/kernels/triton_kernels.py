"""Triton versions of the paged-KV kernels (the torch references are in ``reference.py``).

One module per kernel, each readable on its own:

* ``triton_store_kv``  -- scatter new K/V rows into the paged cache;
* ``triton_decode``    -- decode attention, with online softmax and a split-KV variant;
* ``triton_prefill``   -- causal attention of ragged query chunks over the paged cache.

On CPU the kernels run in Triton's interpreter, which must be enabled with
``TRITON_INTERPRET=1`` before this module is first imported.
"""

from __future__ import annotations

from minibatch.kernels.triton_decode import choose_split, paged_decode_attention
from minibatch.kernels.triton_prefill import paged_prefill_attention
from minibatch.kernels.triton_store_kv import store_kv

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "choose_split"]
