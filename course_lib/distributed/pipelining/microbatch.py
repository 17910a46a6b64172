"""Cut a batch into equal micro-batches, the unit of work a pipeline passes along.

PyTorch counterpart: ``torch.distributed.pipelining.microbatch.split_args_kwargs_into_chunks``
(which also accepts uneven chunks). Here the micro-batches are equal, so that the mean of their
mean losses is the mean loss of the batch and a pipeline's gradient equals one process's.
Lesson 12.
"""
from __future__ import annotations

import torch

__all__ = ["split_microbatches"]


def split_microbatches(X: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``X`` cut along dim 0 into ``num_microbatches`` equal views.

    Raises ValueError when the count is not a positive integer, exceeds the batch, or does not
    divide it (uneven micro-batches would weight examples unequally in the mean loss).
    """
    if not isinstance(X, torch.Tensor) or X.dim() == 0:
        found = "a 0-d tensor" if isinstance(X, torch.Tensor) else type(X).__name__
        raise TypeError(f"split_microbatches expects a batch tensor (B, ...), got {found}.")
    if (not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool)
            or num_microbatches < 1):
        raise ValueError(f"expected a number of micro-batches >= 1, got {num_microbatches!r}.")
    batch = X.shape[0]
    if num_microbatches > batch:
        raise ValueError(f"cannot cut a batch of {batch} example(s) into {num_microbatches} "
                         f"micro-batches: use at most {batch}.")
    if batch % num_microbatches:
        fits = [m for m in range(1, batch + 1) if batch % m == 0]
        raise ValueError(f"{num_microbatches} micro-batches do not divide a batch of {batch} "
                         f"(the pipeline needs equal micro-batches). Use one of {fits[:12]}, or "
                         "a batch size that the count divides.")
    return list(X.split(batch // num_microbatches))  # m views of (B/m, ...)
