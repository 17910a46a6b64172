"""Experimental parallelisms: ``course_lib.distributed.tensor.experimental`` mirrors
``torch.distributed.tensor.experimental``, where torch keeps ``context_parallel``.

- ``context_parallel``: ``ring_attention`` (attention over a sequence split across ranks: keys
  and values travel round a ring, forward and backward) and ``merge_partial_attention`` (the
  online-softmax merge of two partial attentions).
- ``load_balance``: the layouts (``sequence_chunks``, ``zigzag_split``, ``zigzag_gather``) and
  the work each rank does under them (``ring_attention_work``, ``RingAttentionWork``).

Read more: Liu et al. (2023), "Ring Attention with Blockwise Transformers", and notebook 16.
"""
from .context_parallel import merge_partial_attention, ring_attention
from .load_balance import (
    RingAttentionWork,
    block_mask_kind,
    ring_attention_work,
    sequence_chunks,
    zigzag_gather,
    zigzag_split,
)

__all__ = ["RingAttentionWork", "block_mask_kind", "merge_partial_attention", "ring_attention",
           "ring_attention_work", "sequence_chunks", "zigzag_gather", "zigzag_split"]
