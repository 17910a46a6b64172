"""Tensors split across processes: ``course_lib.distributed.tensor`` mirrors
``torch.distributed.tensor``.

- ``parallel``: tensor parallelism (Megatron-LM's column- and row-parallel layers, the
  vocabulary-parallel embedding and loss, a GPT split by heads), lesson 14.
- ``experimental``: context parallelism (ring attention, the zigzag layout), lesson 16.
"""

__all__: list[str] = []  # the names live in its submodules (parallel, experimental)
