"""Mixed precision: ``course_lib.amp`` mirrors ``torch.amp``.

- ``grad_scaler``: ``GradScaler``, the dynamic loss scaler of float16 training, lesson 15.
"""
from .grad_scaler import GradScaler

__all__ = ["GradScaler"]
