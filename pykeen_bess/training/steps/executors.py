"""The executors of the static step: run it directly, or capture it as CUDA graphs and replay them.

The static step (:mod:`~pykeen_bess.training.steps.static_step`) is one function of a step kind with
fixed shapes and no host read. :class:`DirectSteps` runs it as it is (the CPU; on CUDA on a side
stream). :class:`CapturedSteps` captures every step kind once as a CUDA graph
(:class:`torch.cuda.CUDAGraph`, after :attr:`~CapturedSteps.warmup_steps` real steps of the kind on a
side stream, PyTorch's recipe for whole steps) and replays it for every further step of the kind;
where capturing fails (logged with the reason) it runs the same function uncaptured. The
collectives of a process group are captured with the step (NCCL allows it: every rank captures
the same calls).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from pykeen.regularizers import Regularizer

from .device_plan import StepKind

__all__ = [
    "CapturedSteps",
    "DirectSteps",
]

logger = logging.getLogger(__name__)


class DirectSteps:
    """Run the step function directly (on CUDA: on a side stream, as the warm-up of a capture does)."""

    #: whether steps are captured as CUDA graphs
    captures = False

    def __init__(self, step: Callable[[StepKind], None], device: torch.device):
        """Run ``step`` on ``device``."""
        self.step = step
        self.device = device
        #: the steps run of every step kind (by its index)
        self.runs: defaultdict[int, int] = defaultdict(int)
        self._stream: Any = None

    def run(self, kind: StepKind) -> None:
        """Run one step of ``kind``."""
        self._uncaptured(kind)
        self.runs[kind.index] += 1

    def _uncaptured(self, kind: StepKind) -> None:
        if self.device.type != "cuda":
            self.step(kind)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self.step(kind)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def rebind(self) -> None:
        """Before an epoch: nothing to restore (no graph holds memory)."""


class CapturedSteps(DirectSteps):
    """Capture every step kind as a CUDA graph once warm, and replay it."""

    #: real steps of a kind run before it is captured (cuBLAS and the autograd engine warm up)
    warmup_steps = 2
    #: the padded step kinds captured at most (each holds its own graph; further ones run uncaptured)
    max_padded_graphs = 4

    def __init__(self, step: Callable[[StepKind], None], model: Any, optimizer: torch.optim.Optimizer, device: Any):
        """Capture ``step`` on ``device``; ``model`` and ``optimizer`` hold the memory the graphs work on."""
        super().__init__(step, device)
        self.model = model
        self.optimizer = optimizer
        self.captures = True
        #: the graph of every captured step kind (by its index)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._held: list[torch.Tensor] = []  # the regularizers' zero terms a captured graph reads
        self._parameters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its memory at capture)
        self._state_tensors: list[tuple[dict, str, torch.Tensor]] = []  # optimizer state tensors at capture

    def run(self, kind: StepKind) -> None:  # noqa: D102
        graph = self.graphs.get(kind.index)
        if graph is None and self.captures and self.runs[kind.index] >= self.warmup_steps:
            if kind.index <= self.max_padded_graphs:
                graph = self._capture(kind)
        if graph is not None:
            graph.replay()
        else:
            self._uncaptured(kind)
        self.runs[kind.index] += 1

    def _capture(self, kind: StepKind) -> Any:
        """Capture a step of ``kind`` as a CUDA graph; on failure, run every step uncaptured from now on (logged).

        A graph reads and writes the memory its tensors had when it was captured. Two kinds of PyKEEN
        state are therefore pinned down first: a regularizer replaces its term tensor at every update
        (the graph would read the one current at capture, freed afterwards), so each gets a zero term
        this executor holds; and the parameters and optimizer state are recorded, so that between epochs
        (where something may rebind a weight's ``.data``) :meth:`rebind` moves them back.
        """
        if not self._held:
            for module in self.model.modules():
                if isinstance(module, Regularizer):
                    held = torch.zeros_like(module.regularization_term)
                    module.regularization_term = held
                    self._held.append(held)
        self._parameters = [(param, param.data) for param in self.model.parameters()]
        self._state_tensors = [
            (state, name, value)
            for state in self.optimizer.state.values()
            for name, value in state.items()
            if torch.is_tensor(value) and value.device.type == "cuda"
        ]
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.device)
            # thread-local: the thread that draws the next epoch may pin memory meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.step(kind)
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to the same step, uncaptured
            self.captures = False
            self.model.collect_regularization_term()  # drop terms a failed capture left behind
            torch.cuda.synchronize(self.device)
            logger.warning(
                "BESS: the static step could not be captured as a CUDA graph (%s); it runs uncaptured.", error
            )
            return None
        self.graphs[kind.index] = graph
        logger.info(
            "BESS: captured the static step%s as a CUDA graph; every further such step is one replay.",
            f" (padded step kind {kind.index})" if kind.padded else "",
        )
        return graph

    def rebind(self) -> None:
        """Move rebound parameters and replaced optimizer state back into the memory the graphs use.

        PyKEEN's embeddings rebind their weight's ``.data`` when they apply a constraint, and an optimizer
        may replace a state tensor (between epochs, e.g. an evaluation or a callback); a captured graph works
        on the memory it was captured with, so the new values are copied there and the tensors rebound to it.
        """
        with torch.no_grad():
            for param, memory in self._parameters:
                if param.data_ptr() != memory.data_ptr():
                    memory.copy_(param.detach())
                    param.data = memory
            for state, name, value in self._state_tensors:
                current = state.get(name)
                if current is not value and current is not None:
                    value.copy_(current)
                    state[name] = value
