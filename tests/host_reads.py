"""Counting the host's reads of values computed from a model (a GPU would wait for the device there).

:class:`HostReads` is a dispatch mode that follows which tensors derive from the given tensors
(the model's parameters): every operator with such an input marks its outputs. A read of a
scalar from such a tensor on the host (``item``, ``bool``, ``int``, ``float``: the operator
``_local_scalar_dense``) is counted, with the Python line that asked for it. Tensors of the
sampling plan (built on the CPU by design) are not followed.

:class:`DeviceOps` counts every operator of a block of code and, among them, the synchronising
ones (:data:`SYNCHRONISING`) whose inputs derive from the given tensors (the static step's), and
the host-to-device copies a GPU would make (a CUDA graph cannot capture a copy from pageable memory).
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
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


#: operators that make the host wait for a device (a GPU) when their input lives there
SYNCHRONISING = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "equal",
    "is_nonzero",
}


class DeviceOps(TorchDispatchMode):
    """Count the operators of a block of code, and the synchronising ones whose inputs derive from ``sources``.

    ``sources`` are the tensors that live on the compute device in a GPU run (parameters, optimizer
    state, the plan buffers, the step's bookkeeping); every operator with such an input marks its
    outputs. CPU-side constants (the real slots of a step kind, the regularization weights) are not
    followed: reading them costs no device synchronisation.
    """

    def __init__(self, sources: Iterable[torch.Tensor], host: Iterable[torch.Tensor] = ()) -> None:
        """Follow ``sources`` (device tensors in a GPU run); ``host`` are tensors in host memory, never to be read."""
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        #: the synchronising operators and host-to-device copies, each with the line that made it
        self.synchronising: list[str] = []
        self._alive = list(sources)
        self._tracked = {id(t) for t in self._alive}
        # by memory: a view (``detach()``) of a host tensor is a new tensor object
        self._host_memory = {t.untyped_storage().data_ptr() for t in host}
        self._copies = _HostToDevice(self)

    def __enter__(self) -> DeviceOps:
        self._copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._copies.__exit__(*exc)

    def _track(self, out) -> None:
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in self._tracked:
                self._tracked.add(id(tensor))
                self._alive.append(tensor)

    @property
    def total(self) -> int:
        """The number of operators counted."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        tracked = any(id(t) in self._tracked for t in inputs)
        if any(t.untyped_storage().data_ptr() in self._host_memory for t in inputs if t.device.type == "cpu"):
            self.synchronising.append(f"{name} of a host tensor at {_line()}")
        if tracked and name in SYNCHRONISING:
            frame = next((f for f in reversed(traceback.extract_stack()) if "pykeen_bess" in f.filename), None)
            self.synchronising.append(f"{name} at {frame.filename}:{frame.lineno}" if frame else name)
        out = func(*args, **(kwargs or {}))
        if tracked:
            self._track(out)
        return out


#: the functions that create a tensor (on the device when they are given one)
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor}


def _line() -> str:
    frame = next((f for f in reversed(traceback.extract_stack()) if "pykeen_bess" in f.filename), None)
    return f"{frame.filename}:{frame.lineno}" if frame else "?"


class _HostToDevice(TorchFunctionMode):
    """The host-to-device copies of :class:`DeviceOps`: a tensor not derived from its sources sent to a device.

    On the CPU such a copy is no operator at all (``to`` returns the tensor itself), so it is seen where
    Python asks for it: ``to``/``cuda`` with a device (or a tensor of the sources), and ``copy_`` into a
    source from another tensor. A factory given a device makes a device tensor (followed from then on).
    """

    def __init__(self, ops: DeviceOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracked = self.ops._tracked
        if func in _FACTORIES and kwargs.get("device") is not None:
            self.ops._track(out)
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and id(args[0]) not in tracked:
            target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))]
            target += [a for a in (*args[1:], kwargs.get("other")) if isinstance(a, torch.Tensor) and id(a) in tracked]
            if target or func is torch.Tensor.cuda:
                self.ops.synchronising.append(f"host-to-device copy ({func.__name__}) at {_line()}")
                self.ops._track(out)
        elif func is torch.Tensor.copy_ and id(args[0]) in tracked and id(args[1]) not in tracked:
            self.ops.synchronising.append(f"host-to-device copy (copy_) at {_line()}")
        return out


def static_step_sources(static) -> list[torch.Tensor]:
    """Return the tensors of a static step that live on the device in a GPU run (see :class:`DeviceOps`)."""
    loop_state = [t for state in static.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    plan = static.plan
    kinds = [t for kind in plan.kinds for t in (kind.device_valid, kind.fallback) if t is not None]
    real = [mask for mask in static.real if mask is not None]
    return [
        *static.model.parameters(),
        *(table.weight for table in static.tables),
        *plan.buffers.values(),
        *plan.triples.values(),
        *([plan.weights] if plan.weights is not None else []),
        *kinds,
        *real,
        *static.copies.tensors(),
        *static.update.learning_rates,
        *static.update.step_counts.values(),
        plan.step_index,
        static.healthy,
        static.applied,
        static.loss_sum,
        static.last_loss,
        *loop_state,
    ]
