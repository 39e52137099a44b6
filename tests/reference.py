"""Straightforward reference computations that the sharded implementation is compared against."""

from __future__ import annotations

from typing import Any

import torch
from pykeen.models import ERModel

from pykeen_bess.data.sampling import BessBatch
from pykeen_bess.data.sharding import EntitySharding


def _map(x: Any, func) -> Any:
    return tuple(func(part) for part in x) if isinstance(x, (tuple, list)) else func(x)


def reference_scores(
    model: ERModel, sharding: EntitySharding, batch: BessBatch, grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the batch computed with global ids on the unsharded model, by PyKEEN's interaction.

    :returns: positive scores ``[n, n, b]`` and negative scores ``[n, n, b, K]``
    """
    n, b = batch.n_shard, batch.block_size
    shard_i = torch.arange(n).view(n, 1, 1).expand(n, n, b)
    shard_j = torch.arange(n).view(1, n, 1).expand(n, n, b)
    heads = sharding.to_global(shard_i, batch.heads)
    tails = sharding.to_global(shard_j, batch.tails)
    owner = torch.arange(n).view(n, 1, 1, 1).expand_as(batch.negatives)
    # [k, i, j, m] -> [i, j, k * m]: candidate order k-major
    negatives = sharding.to_global(owner, batch.negatives).permute(1, 2, 0, 3).reshape(n, n, -1)
    with torch.set_grad_enabled(grad):
        h, r, t = model._get_representations(h=heads, r=batch.relations, t=tails, mode=None)
        positive = model.interaction(h=h, r=r, t=t)
        candidate_h, _, candidate_t = model._get_representations(h=negatives, r=None, t=negatives, mode=None)
        nh = batch.num_head_corrupted
        parts = []
        if nh > 0:
            parts.append(
                model.interaction(
                    h=_map(candidate_h, lambda x: x.unsqueeze(2)),
                    r=_map(r, lambda x: x[:, :, :nh].unsqueeze(3)),
                    t=_map(t, lambda x: x[:, :, :nh].unsqueeze(3)),
                )
            )
        if nh < b:
            parts.append(
                model.interaction(
                    h=_map(h, lambda x: x[:, :, nh:].unsqueeze(3)),
                    r=_map(r, lambda x: x[:, :, nh:].unsqueeze(3)),
                    t=_map(candidate_t, lambda x: x.unsqueeze(2)),
                )
            )
    return positive, torch.cat(parts, dim=2)
