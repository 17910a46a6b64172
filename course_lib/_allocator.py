"""The CPU allocator's part in a timing, beside ``course_lib.timing`` (which re-exports it):
``keep_freed_memory`` and ``page_faults`` (lesson 12).
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory", "page_faults"]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(max_bytes: int = 32 * 2**20) -> bool:
    """Make this process's C allocator keep freed blocks of up to ``max_bytes`` for reuse.

    On a CPU, torch allocates tensors with the C library's ``malloc``. glibc's ``malloc``
    hands a large freed block back to the operating system (``munmap``, or trimming the heap),
    so the next tensor of that size page-faults its memory in again: the first touch of each
    4 KiB page costs a trip into the kernel. Whether a given allocation does depends on what
    the process allocated and freed before (glibc moves its thresholds as it goes), so the
    same layer can time differently in different company. This sets glibc's mmap threshold to
    ``max_bytes`` and stops heap trimming: freed blocks stay in the process and are reused, as
    PyTorch's CUDA caching allocator does on a GPU. It lasts for the rest of the process.

    Args:
        max_bytes: the largest block kept (glibc accepts at most 32 MiB on 64-bit Linux); a
            larger tensor is still mapped and unmapped on each allocation.

    Returns:
        True where it took effect (glibc), False elsewhere (another C library or OS).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(max_bytes))
                and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def page_faults() -> int:
    """Minor page faults of this process so far (the OS mapping a page on its first touch);
    the difference over a call counts the pages it took from the OS. 0 where the OS does not
    say (``resource`` is Unix only)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


