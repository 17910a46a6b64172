"""What ``ZeroRedundancyOptimizer`` checks before it trusts its arguments (errors that help)."""
from __future__ import annotations

import torch.distributed as dist

from .._same_tensors import verify_same_tensors

#: torch's keywords that only its own ZeroRedundancyOptimizer implements, and what they do
TORCH_ONLY_OPTIONS = {
    "parameters_as_bucket_view": "packs each rank's parameters into flat buckets whose views "
                                 "become the parameters",
    "overlap_with_ddp": "runs each shard's step inside DDP's communication hook, overlapped "
                        "with backward",
}


def check_torch_options(**options: object) -> None:
    """Accept torch's ZeRO-only keywords at their default (False); refuse True clearly."""
    for name, value in options.items():
        if not isinstance(value, bool):
            raise TypeError(f"ZeroRedundancyOptimizer: {name} must be True or False, got "
                            f"{value!r}.")
        if value:
            raise NotImplementedError(
                f"ZeroRedundancyOptimizer: {name}=True is an option of torch's version (it "
                f"{TORCH_ONLY_OPTIONS[name]}); this course's version does not implement it. "
                f"Leave it out (or pass {name}=False) to use this one, or use "
                f"torch.distributed.optim.ZeroRedundancyOptimizer for it.")


def check_same_params(param_groups: list[dict], group: dist.ProcessGroup | None) -> None:
    """Raise on every rank unless every rank passed the same parameters in the same groups
    (else the ranks would partition differently, and gloo would go on, silently wrong)."""
    states = [(f"param_groups[{g}]", f"parameter {j}", p)
              for g, param_group in enumerate(param_groups)
              for j, p in enumerate(param_group["params"])]
    verify_same_tensors(
        states, group, owner="ZeroRedundancyOptimizer", expects="the same parameters",
        noun="parameters",
        advice="Pass every rank the same parameters, in the same order and the same groups "
               "(build the model the same way on every rank, then give its parameters()).")
