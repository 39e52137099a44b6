"""Counting the host's reads of values computed from a model (a GPU would wait for the device there).

:class:`HostReads` is a dispatch mode that follows which tensors derive from the given tensors
(the model's parameters): every operator with such an input marks its outputs. A read of a
scalar from such a tensor on the host (``item``, ``bool``, ``int``, ``float``: the operator
``_local_scalar_dense``) is counted, with the Python line that asked for it. Tensors of the
sampling plan (built on the CPU by design) are not followed.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostReads(TorchDispatchMode):
    """Count host reads of values derived from ``sources``."""

    def __init__(self, sources: Iterable[torch.Tensor]) -> None:
        super().__init__()
        # ids of the followed tensors, and the tensors themselves (alive, so that no id is reused)
        self._tracked: set[int] = set()
        self._alive: list[torch.Tensor] = []
        for tensor in sources:
            self._track(tensor)
        #: the Python source line of every read
        self.reads: list[str] = []

    def _track(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self._tracked:
            self._tracked.add(id(tensor))
            self._alive.append(tensor)

    def _is_tracked(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._tracked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        tracked = any(self._is_tracked(t) for t in inputs)
        if tracked and func is torch.ops.aten._local_scalar_dense.default:
            frame = next((f for f in reversed(traceback.extract_stack()) if "pykeen_bess" in f.filename), None)
            self.reads.append(f"{frame.filename}:{frame.lineno} {frame.line}" if frame else "?")
        out = func(*args, **(kwargs or {}))
        if tracked:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._track(tensor)
        return out
