"""The sizes of a score block: queries per batch and candidates per slice, by probe when not given.

Without explicit sizes the ``[batch, slice]`` block is bounded to :data:`CPU_BLOCK_BYTES` on the CPU
and checked by an out-of-memory-catching probe agreed by all processes
(:func:`pykeen_bess.runtime.memory.search_largest`), unless the memory budget holds
:data:`CPU_PROBE_MARGIN` such blocks (the usual case: a probe costs a block's scoring, a tenth of a
first evaluation of an FB15k-237-sized graph). On a GPU the block is sized from the free device
memory instead (:func:`cuda_block_sizes`: a ``1 / CUDA_MEMORY_FRACTION`` share of it, between
:data:`CUDA_BLOCK_BYTES` and :data:`CUDA_MAX_BLOCK_BYTES`), whole shards per slice where that
leaves at least :data:`CUDA_MIN_BATCH` queries per batch: no probe runs (a probe synchronises
and costs a whole block), and few large blocks keep the GPU busy with few launches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..runtime.memory import available_memory, fits_in_memory, search_largest

if TYPE_CHECKING:
    from .sharded import ShardedScoring

__all__ = [
    "CPU_BLOCK_BYTES",
    "CPU_PROBE_MARGIN",
    "CUDA_BLOCK_BYTES",
    "CUDA_MAX_BLOCK_BYTES",
    "CUDA_MEMORY_FRACTION",
    "CUDA_MIN_BATCH",
    "DEFAULT_SLICE_SIZE",
    "TRIVIAL_BLOCK_BYTES",
    "choose_block_sizes",
    "cuda_block_sizes",
]

#: the default bound of one ``[batch, slice]`` score block on the CPU, in bytes
CPU_BLOCK_BYTES = 32 * 2**20
#: a CPU block of at most this fraction's inverse of the memory budget is not probed (a probe of DistMult d=256 on
#: WN18RR and a generated FB15k-237-sized graph peaked at 1.1-1.5 times its block's bytes)
CPU_PROBE_MARGIN = 8
#: the smallest score block on a GPU, in bytes (if the free memory allows)
CUDA_BLOCK_BYTES = 256 * 2**20
#: the largest score block on a GPU, in bytes
CUDA_MAX_BLOCK_BYTES = 2 * 2**30
#: a score block on a GPU takes at most this fraction's inverse of the free memory (its comparisons need a few more)
CUDA_MEMORY_FRACTION = 8
#: on a GPU, a slice covers a whole shard if at least this many queries (or all) still fit into a block
CUDA_MIN_BATCH = 256
#: the default number of candidates scored at once per shard
DEFAULT_SLICE_SIZE = 4096
#: score blocks of all queries against all candidates of a shard up to this size are used without a probe
TRIVIAL_BLOCK_BYTES = 4 * 2**20


def choose_block_sizes(
    scoring: ShardedScoring,
    num_queries: int,
    batch_size: int | None,
    slice_size: int | None,
    probe: Callable[[int, int], None],
    device: torch.device,
    memory_budget: int | None = None,
) -> tuple[int, int]:
    """Choose the number of queries per batch and of candidates per slice.

    Given sizes are kept (at most the queries, and a shard's candidates). If all queries against all
    candidates of a shard make a block of at most :data:`TRIVIAL_BLOCK_BYTES`, that is used without
    probing. Otherwise missing sizes start from a score block of :data:`CPU_BLOCK_BYTES` (CPU; the
    search does not grow beyond it, larger
    blocks are not faster there) or :data:`CUDA_BLOCK_BYTES` (GPU; the batch may grow up to
    ``num_queries``), with slices of :data:`DEFAULT_SLICE_SIZE` candidates, and are halved until
    ``probe(batch_size, slice_size)`` fits, the decision agreed by all processes. On the CPU a block whose
    bytes fit :data:`CPU_PROBE_MARGIN` times into the budget fits without a probe.

    :param scoring: the scoring (for the candidate counts, the dtype and the topology)
    :param num_queries: the number of evaluation triples (queries per target)
    :param batch_size: the batch size, or None to choose
    :param slice_size: the slice size, or None to choose
    :param probe: runs one step of ``(batch_size, slice_size)`` without communicating
    :param device: the evaluation device
    :param memory_budget: the largest peak of a probe in bytes (CPU default: half the available
        memory; GPU default: only out-of-memory errors count)
    :returns: ``(batch_size, slice_size)``
    :raises MemoryError: if not even a single query against a single candidate fits
    """
    for name, value in (("batch_size", batch_size), ("slice_size", slice_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, but is {value!r}.")
    max_columns = max(1, scoring.max_columns)
    num_queries = max(1, num_queries)
    # given sizes beyond the queries and a shard's candidates would only allocate larger blocks (the metrics do
    # not depend on the blocks)
    batch_size = None if batch_size is None else min(batch_size, num_queries)
    slice_size = None if slice_size is None else min(slice_size, max_columns)
    if batch_size is not None and slice_size is not None:
        return batch_size, slice_size
    itemsize = _score_itemsize(scoring)
    if num_queries * max_columns * itemsize <= TRIVIAL_BLOCK_BYTES:
        # everything in one block per shard, far below the default block: nothing to search
        return batch_size or num_queries, slice_size or max_columns
    if device.type == "cuda":
        return cuda_block_sizes(num_queries, max_columns, itemsize, batch_size, slice_size, device, memory_budget)
    block_bytes = CUDA_BLOCK_BYTES if device.type == "cuda" else CPU_BLOCK_BYTES
    block_elements = max(1, block_bytes // itemsize)
    budget = memory_budget
    if budget is None and device.type != "cuda":
        available = available_memory(device)
        budget = None if available is None else available // 2
    topology = scoring.topology

    def fits(batch: int, slice_: int) -> bool:
        if device.type != "cuda" and budget is not None and CPU_PROBE_MARGIN * batch * slice_ * itemsize <= budget:
            return True  # far below the budget (the processes still agree on it)
        return fits_in_memory(lambda: probe(batch, slice_), device, budget)[0]

    if batch_size is None:
        slice_start = min(max_columns, DEFAULT_SLICE_SIZE) if slice_size is None else min(slice_size, max_columns)
        batch_start = max(1, min(num_queries, block_elements // slice_start))
        maximum = num_queries if device.type == "cuda" else batch_start
        batch_size, found = search_largest(
            lambda b: fits(b, slice_start),
            start=batch_start,
            maximum=maximum,
            topology=topology,
            description="batch_size",
        )
        if found or slice_size is not None:
            if not found:
                raise MemoryError(f"Not even one query against slice_size={slice_size} candidates fits in memory.")
            return batch_size, slice_size if slice_size is not None else slice_start
        slice_size = slice_start
    # a given (small) batch gets the rest of the block as slice, within a sane bound
    slice_start = min(max_columns, max(1, block_elements // batch_size), DEFAULT_SLICE_SIZE * 16)
    maximum = max_columns if device.type == "cuda" else slice_start
    slice_size, found = search_largest(
        lambda s: fits(batch_size, s), start=slice_start, maximum=maximum, topology=topology, description="slice_size"
    )
    if not found:
        raise MemoryError(f"Not even batch_size={batch_size} queries against one candidate fit in memory.")
    return batch_size, slice_size


def cuda_block_sizes(
    num_queries: int,
    max_columns: int,
    itemsize: int,
    batch_size: int | None,
    slice_size: int | None,
    device: torch.device,
    memory_budget: int | None = None,
) -> tuple[int, int]:
    """Size the block on a GPU from its free memory (see the module docstring); given sizes are kept.

    :param num_queries: the number of queries per target
    :param max_columns: the most candidates of a local shard
    :param itemsize: the bytes of one score
    :param batch_size: the batch size, or None to choose
    :param slice_size: the slice size, or None to choose
    :param device: the GPU
    :param memory_budget: if given, a block takes at most an eighth of it instead of the free memory's share
    :returns: ``(batch_size, slice_size)``
    """
    if memory_budget is not None:
        block_bytes = memory_budget // CUDA_MEMORY_FRACTION
    else:
        free, _ = torch.cuda.mem_get_info(device)
        block_bytes = min(max(free // CUDA_MEMORY_FRACTION, CUDA_BLOCK_BYTES), CUDA_MAX_BLOCK_BYTES, free // 2)
    block_elements = max(1, block_bytes // itemsize)
    if slice_size is None:
        queries = min(num_queries, CUDA_MIN_BATCH) if batch_size is None else batch_size
        slice_size = max(1, min(max_columns, block_elements // max(1, queries)))
    if batch_size is None:
        batch_size = max(1, min(num_queries, block_elements // slice_size))
    return batch_size, slice_size


def _score_itemsize(scoring: ShardedScoring) -> int:
    """Return the bytes of one score (the real dtype of the entity representations)."""
    template = scoring.rows.rows(0, slice(0, 0))[0]
    dtype = template.real.dtype if template.is_complex() else template.dtype
    return torch.empty(0, dtype=dtype).element_size() if dtype.is_floating_point else 4
