"""Which of a block's triples each slot of a step holds (:func:`slot_offsets`), padding included."""

from __future__ import annotations

import warnings

import torch

__all__ = ["head_slots", "slot_offsets"]

#: with corruption ``"ht"``, blocks of an odd size below this corrupt heads visibly less often than tails
#: (``(b - 1) / 2b``: 0% for one slot, 33% for three, ... 44% for nine) and are warned about
UNEVEN_BELOW = 10


def head_slots(block_size: int, corruption: str) -> int:
    """Return how many leading slots of a block corrupt the head: all (``"h"``), none (``"t"``), ``b // 2`` (``"ht"``).

    With ``"ht"`` and an odd block size below :data:`UNEVEN_BELOW` (one slot: no head corrupted at all) a
    warning says the share, since PyKEEN's sampler corrupts both sides equally.
    """
    if corruption == "h":
        return block_size
    if corruption == "t":
        return 0
    heads = block_size // 2
    if block_size % 2 and block_size < UNEVEN_BELOW:
        warnings.warn(
            f"corruption='ht' with blocks of {block_size} slots: {heads} of each full block's slots corrupt the head, "
            f"{heads / block_size:.0%} of the positives (PyKEEN's sampler: 50%). A batch size that is a multiple of "
            "2 * num_shards**2 gives blocks of an even size, which corrupt both sides equally (a batch holding more "
            "than every shardpair's triples gets blocks of the largest shardpair's size: then choose a smaller one).",
            UserWarning,
            stacklevel=3,
        )
    return heads


def slot_offsets(real: torch.Tensor, block_size: int, num_head_corrupted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return which of a block's triples of a step each slot holds, and whether it holds one (padding: not).

    A block's ``real`` triples of the step fill its slots in order, except with corruption ``"ht"``
    (``0 < num_head_corrupted < block_size``) in a block they do not fill: then its head-corrupted first
    slots take ``ceil(real / 2)`` of them (at most that part's size) and its tail-corrupted rest the others,
    so that a partly filled block corrupts both sides as a full one does (filled in order, a block at
    most half full would corrupt only heads: a batch of twice the training set, or more, corrupted no
    tail at all). A full block's slots hold its triples in order either way.

    :param real: shape: ``[*s, 1]``, each block's real triples in the step (``0 .. block_size``)
    :param block_size: the slots of a block, ``b``
    :param num_head_corrupted: the block's leading slots that corrupt their head
    :returns: the offset of each slot's triple among the block's triples of the step, shape ``[*s, b]``
        (a padding slot's is meaningless), and whether a slot is real, shape ``[*s, b]``
    """
    b, h = block_size, num_head_corrupted
    slot = torch.arange(b)
    if not 0 < h < b:
        return slot.expand(*real.shape[:-1], b), slot < real
    head_real = torch.div(real + 1, 2, rounding_mode="floor").clamp_max(h)
    in_head = slot < h
    offsets = torch.where(in_head, slot, head_real + slot - h)
    valid = torch.where(in_head, slot < head_real, slot - h < real - head_real)
    return offsets, valid
