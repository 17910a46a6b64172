"""Record a process's point-to-point calls, to check them against NCCL's rules on CPUs.

NCCL runs a rank's point-to-point operations in order on one stream: a receive and a send
queued as separate operations wait for each other across ranks (NVIDIA/nccl#479), while gloo,
which CI runs, never shows it. ``P2PTrace`` patches ``torch.distributed``'s ``isend``,
``irecv``, ``send``, ``recv`` and ``batch_isend_irecv`` inside a worker and records each
operation (direction, peer, elements, dtype, tag, the batch it went in) and each wait, so that a
test can assert the pattern itself: ``unbatched_overlaps`` lists the moments a send and a receive
were outstanding at once outside one batch.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


class _Work:
    """A ``dist.Work`` whose ``wait`` is recorded."""

    def __init__(self, work, trace: P2PTrace, ids: list[int]):
        self._work, self._trace, self._ids = work, trace, ids

    def wait(self, *args, **kwargs):
        self._trace.calls.append({"wait": self._ids})
        return self._work.wait(*args, **kwargs) if self._work is not None else True

    def is_completed(self) -> bool:
        return self._work.is_completed()


class P2PTrace:
    """``with P2PTrace() as trace:`` ... ``trace.calls``: posts ``{"op", "peer", "numel",
    "dtype", "tag", "id", "batch"}`` (batch: None for an operation of its own) and waits
    ``{"wait": [ids]}``."""

    def __init__(self):
        self.calls: list[dict] = []
        self._batch: int | None = None
        self._blocking = False
        self._saved: dict = {}
        self._batches = 0

    def _post(self, op: str, tensor, peer, tag) -> int:
        self.calls.append({"op": op, "peer": peer, "numel": tensor.numel(),
                           "dtype": tensor.dtype, "tag": tag, "id": len(self.calls),
                           "batch": self._batch})
        return self.calls[-1]["id"]

    def _wrap(self, name: str, original):
        if name == "batch_isend_irecv":
            def batch(p2p_op_list):
                self._batch, self._batches = self._batches, self._batches + 1
                first = len(self.calls)
                try:
                    works = original(p2p_op_list)
                finally:
                    self._batch = None
                ids = [c["id"] for c in self.calls[first:] if "op" in c]
                if len(works) == len(ids):          # one work per operation
                    return [_Work(w, self, [i]) for w, i in zip(works, ids)]
                return [_Work(w, self, ids) for w in works]
            return batch

        def p2p(tensor, *args, **kwargs):
            if self._blocking:                       # send / recv calling isend / irecv
                return original(tensor, *args, **kwargs)
            peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
            if peer is None:
                peer = kwargs.get("group_dst", kwargs.get("group_src"))
            tag = kwargs.get("tag", args[2] if len(args) > 2 else 0)
            op_id = self._post(name, tensor, peer, tag)
            self._blocking = name in ("send", "recv")
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                self._blocking = False
            if self._batch is not None:
                return result                        # batch() wraps the works
            if name in ("send", "recv"):             # blocking: done on return
                self.calls.append({"wait": [op_id]})
                return result
            return _Work(result, self, [op_id])
        return p2p

    def __enter__(self) -> P2PTrace:
        for name in _NAMES:
            original = getattr(c10d, name)
            wrapper = self._wrap(name, original)
            for module in (dist, c10d):     # P2POp checks its op against c10d's own names
                self._saved[module, name] = getattr(module, name)
                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), original in self._saved.items():
            setattr(module, name, original)

    # ---- reading the trace -----------------------------------------------------------------

    def posts(self) -> list[dict]:
        return [c for c in self.calls if "op" in c]

    def batches(self) -> list[list[dict]]:
        """The operations of each ``batch_isend_irecv``, in order."""
        out: dict[int, list[dict]] = {}
        for c in self.posts():
            if c["batch"] is not None:
                out.setdefault(c["batch"], []).append(c)
        return [out[k] for k in sorted(out)]

    def unbatched_overlaps(self) -> list[str]:
        """Each moment a send and a receive were both outstanding without sharing one batch.

        An operation is alone when it is not in a batch, or in a batch of one; it is outstanding
        from its post until a wait covers it (a blocking send or recv: until it returns). On
        NCCL such a pair can deadlock, whichever comes first.
        """
        sizes: dict[int, int] = {}
        for c in self.posts():
            if c["batch"] is not None:
                sizes[c["batch"]] = sizes.get(c["batch"], 0) + 1
        outstanding: dict[int, dict] = {}
        found = []
        for c in self.calls:
            if "wait" in c:
                for i in c["wait"]:
                    outstanding.pop(i, None)
                continue
            alone = c["batch"] is None or sizes[c["batch"]] == 1
            if not alone:
                continue
            sending = "send" in c["op"]
            for other in outstanding.values():
                if ("send" in other["op"]) != sending:
                    found.append(f"{c['op']} to/from {c['peer']} posted while {other['op']} "
                                 f"to/from {other['peer']} is outstanding")
            outstanding[c["id"]] = c
        return found
