"""Stage 1 variant: a random sharding refined until its shardpairs hold equal numbers of triples.

An epoch of BESS has ``ceil(max_pair_count / block_size)`` steps (:mod:`pykeen_bess.data.sampling`):
the largest of the ``n ** 2`` shardpairs sets the number of steps, and the slots that the smaller
shardpairs cannot fill are padding, computed and thrown away. With a random sharding, hub
entities make some shardpairs several percent larger than the mean ``T / n ** 2``: on WN18RR with
seed 0, 4 shards of a random permutation give 185 steps of 512 slots per epoch where 170 would
hold every triple (8% padding), and 8 shards 213 (20%).

:func:`balance_shards` starts from a random assignment and swaps entities between shards, so
every shard keeps its size (on WN18RR with 4 shards, 1% of the entities move), until the largest
shardpair is within ``tolerance`` of the mean. Each round

1. counts the triples of every shardpair exactly, ``C`` ``[n, n]``, and its excess over the
   mean, ``E = n ** 2 * C - T`` (integers: every process computes the same result);
2. proposes a random other shard for every entity and estimates the gain of the move from the
   excess of the shardpairs its triples leave and enter;
3. pairs the best ``a -> b`` movers with the best ``b -> a`` movers and accepts a swap, one
   after the other, when it lowers the objective ``sum(max(E, 0) ** 2)`` (the overfull pairs'
   squared excess), evaluated from the two entities' per-shard triple counts; a rejected swap
   drops the entity with more triples (the likelier to overshoot) and tries the next one;
4. keeps the round only if the exact recount confirms a lower objective.

A round costs a few passes over the triples (about 2 s for 17M triples on 2 cores); rounds stop
at ``max_rounds`` (by default fewer for larger graphs), at the tolerance, or after two rounds in
a row that gained nothing. All
randomness comes from the caller's generator: the same triples, seed and number of shards give
the same sharding in every process.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "balance_shards",
    "pair_counts",
]

#: triples times rounds that the default number of rounds may cost (about 2 s per 17M on 2 cores)
ROUND_BUDGET = 100_000_000


def pair_counts(entity_shard: torch.Tensor, heads: torch.Tensor, tails: torch.Tensor, n_shard: int) -> torch.Tensor:
    """Count the triples of every shardpair.

    :param entity_shard: shape: ``[N]``, the shard of every entity
    :param heads: shape: ``[T]``, head ids
    :param tails: shape: ``[T]``, tail ids
    :param n_shard: the number of shards ``n``
    :returns: shape: ``[n, n]``, int64: entry ``(i, j)`` counts the triples with the head on shard ``i``
        and the tail on shard ``j``
    """
    pair = entity_shard[heads] * n_shard + entity_shard[tails]
    return torch.bincount(pair, minlength=n_shard * n_shard).view(n_shard, n_shard)


def _objective(excess: np.ndarray) -> float:
    """Return the overfull pairs' squared excess (float64: large graphs overflow int64 squares)."""
    over = np.maximum(excess, 0).astype(np.float64)
    return float((over * over).sum())


class _Triples:
    """The triples as NumPy arrays, and the shardpair of every triple under an assignment."""

    def __init__(self, heads: torch.Tensor, tails: torch.Tensor, n: int):
        self.heads = heads.cpu().numpy()
        self.tails = tails.cpu().numpy()
        self.n = n
        #: shape: ``[T]``, bool: the self-loops, which move both ends at once (the estimates leave them
        #: to the exact recount)
        self.loops = self.heads == self.tails
        self.has_loops = bool(self.loops.any())

    def pairs(self, shard: np.ndarray) -> np.ndarray:
        """Return the shardpair ``i * n + j`` of every triple, shape: ``[T]`` (int16 for up to 181 shards)."""
        dtype = np.int16 if self.n * self.n <= np.iinfo(np.int16).max else np.int64
        return shard[self.heads].astype(dtype) * dtype(self.n) + shard[self.tails]

    def excess(self, pairs: np.ndarray) -> np.ndarray:
        """Return ``n ** 2 * C - T`` per shardpair, shape: ``[n * n]``, int64."""
        counts = np.bincount(pairs, minlength=self.n * self.n).astype(np.int64)
        return counts * self.n * self.n - self.heads.size


def balance_shards(
    entity_shard: torch.Tensor,
    heads: torch.Tensor,
    tails: torch.Tensor,
    n_shard: int,
    generator: torch.Generator,
    max_rounds: int | None = None,
    tolerance: float = 0.002,
    candidates: int = 4096,
    patience: int = 2,
) -> torch.Tensor:
    """Swap entities between shards until the shardpairs hold about equally many triples.

    :param entity_shard: shape: ``[N]``, the initial shard of every entity (e.g. a random deal)
    :param heads: shape: ``[T]``, head ids of the training triples
    :param tails: shape: ``[T]``, tail ids
    :param n_shard: the number of shards ``n``
    :param generator: the random stream of the proposals
    :param max_rounds: the most rounds; default: 20 for up to 5M triples, fewer for more (at least 4,
        e.g. 5 for 17M triples), so balancing stays within seconds
    :param tolerance: stop once the largest shardpair holds at most ``(1 + tolerance) * T / n ** 2`` triples
    :param candidates: the most swaps tried per round (split over the ``n (n - 1)`` directions)
    :param patience: stop after this many rounds in a row that did not lower the objective
    :returns: shape: ``[N]``, int64, the new shard of every entity; every shard holds as many entities
        as before
    """
    n = int(n_shard)
    if n < 2 or heads.numel() == 0:
        return entity_shard.to(torch.long, copy=True)
    triples = _Triples(heads, tails, n)
    dtype = np.int8 if n <= 127 else np.int32
    shard = entity_shard.cpu().numpy().astype(dtype)
    sizes = np.bincount(shard, minlength=n)
    pairs = triples.pairs(shard)
    excess = triples.excess(pairs)
    objective = _objective(excess)
    limit = tolerance * heads.numel()  # in units of 1 / n**2 triples, as the excess
    per_direction = max(1, candidates // (n * (n - 1)))
    if max_rounds is None:
        max_rounds = min(20, max(4, ROUND_BUDGET // heads.numel()))
    failed = 0
    for _ in range(max_rounds):
        if excess.max() <= limit or failed == patience:
            break
        target, gain = _propose(shard, pairs, excess, triples, generator)
        movers = _best_movers(shard, target, gain, n, per_direction)
        new_shard = _swap(shard, movers, excess, triples)
        if new_shard is not None:
            new_pairs = triples.pairs(new_shard)
            new_excess = triples.excess(new_pairs)
            new_objective = _objective(new_excess)
            if new_objective < objective:
                shard, pairs, excess, objective = new_shard, new_pairs, new_excess, new_objective
                failed = 0
                continue
        failed += 1  # the next round's proposals differ: give them a chance
    if not np.array_equal(np.bincount(shard, minlength=n), sizes):
        raise AssertionError("Balancing changed the number of entities of a shard.")  # pragma: no cover
    return torch.from_numpy(shard.astype(np.int64))


def _propose(
    shard: np.ndarray, pairs: np.ndarray, excess: np.ndarray, triples: _Triples, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Propose another shard for every entity; estimate each move's gain.

    :returns: the proposed shard ``[N]`` and the estimated gain ``[N]`` (float64 holding integers;
        larger is better): per triple of the entity, the excess of the pair it leaves minus that of
        the pair it enters, minus ``n ** 2`` (the move's own triple)
    """
    n, num_entities = triples.n, shard.size
    step = torch.randint(1, n, (num_entities,), generator=generator).numpy()
    target = ((shard + step) % n).astype(shard.dtype)
    heads, tails = triples.heads, triples.tails
    current = excess[pairs] - n * n
    # the pair entered when the head moves: the target's row, the same column (and vice versa)
    leave_head = current - excess[(target[heads] - shard[heads]).astype(pairs.dtype) * pairs.dtype.type(n) + pairs]
    leave_tail = current - excess[(target[tails] - shard[tails]).astype(pairs.dtype) + pairs]
    if triples.has_loops:
        leave_head[triples.loops] = 0
        leave_tail[triples.loops] = 0
    gain = np.bincount(heads, weights=leave_head, minlength=num_entities)
    gain += np.bincount(tails, weights=leave_tail, minlength=num_entities)
    return target, gain


def _best_movers(
    shard: np.ndarray, target: np.ndarray, gain: np.ndarray, n: int, per_direction: int
) -> dict[tuple[int, int], np.ndarray]:
    """Return, per direction ``(a, b)``, the entities proposed to move from ``a`` to ``b``, best first.

    Each direction keeps its ``per_direction`` best (by estimated gain, ties by id).
    """
    dtype = np.int16 if n * n <= np.iinfo(np.int16).max else np.int64
    direction = shard.astype(dtype) * dtype(n) + target
    order = np.argsort(-gain, kind="stable")  # the best first, ties by id
    order = order[np.argsort(direction[order], kind="stable")]  # grouped by direction
    sizes = np.bincount(direction, minlength=n * n)
    movers = {}
    start = 0
    for index, size in enumerate(sizes.tolist()):
        a, b = divmod(index, n)
        if a != b:
            movers[a, b] = order[start : start + min(size, per_direction)]
        start += size
    return movers


def _swap(
    shard: np.ndarray, movers: dict[tuple[int, int], np.ndarray], excess: np.ndarray, triples: _Triples
) -> np.ndarray | None:
    """Try the movers' swaps one after the other; return the new assignment (None if no swap helps).

    A swap's effect is evaluated from the two entities' triple counts per shard of the other end,
    taken at the start of the round (exact but for triples between two entities moved in the same
    round; the caller recounts).
    """
    n = triples.n
    chosen = np.unique(np.concatenate(list(movers.values())))
    if chosen.size == 0:
        return None
    # per chosen entity: triples as head by the tail's shard, as tail by the head's shard, self-loops
    slot = np.full(shard.size, -1, dtype=np.int64)
    slot[chosen] = np.arange(chosen.size)
    k = chosen.size
    heads, tails = triples.heads, triples.tails
    head_slot, tail_slot = slot[heads], slot[tails]
    as_head = np.flatnonzero((head_slot >= 0) & ~triples.loops)
    as_tail = np.flatnonzero((tail_slot >= 0) & ~triples.loops)
    by_tail = np.bincount(head_slot[as_head] * n + shard[tails[as_head]], minlength=k * n).reshape(k, n)
    by_head = np.bincount(tail_slot[as_tail] * n + shard[heads[as_tail]], minlength=k * n).reshape(k, n)
    loops = np.flatnonzero(triples.loops & (head_slot >= 0))
    self_loops = np.bincount(head_slot[loops], minlength=k)
    degree = by_tail.sum(axis=1) + by_head.sum(axis=1) + self_loops
    shard = shard.copy()
    objective = _objective(excess)
    unit = n * n
    swapped = 0

    def change(entity: int, source: int, target: int) -> np.ndarray:
        """Return the change of the excess ``[n * n]`` when an entity moves from ``source`` to ``target``."""
        index = slot[entity]
        delta = np.zeros((n, n), dtype=np.int64)
        delta[source, :] -= by_tail[index]
        delta[target, :] += by_tail[index]
        delta[:, source] -= by_head[index]
        delta[:, target] += by_head[index]
        delta[source, source] -= self_loops[index]
        delta[target, target] += self_loops[index]
        return delta.reshape(-1) * unit

    for a in range(n):
        for b in range(a + 1, n):
            forward, backward = movers[a, b], movers[b, a]
            i = j = 0
            while i < len(forward) and j < len(backward):
                e, f = int(forward[i]), int(backward[j])
                trial = excess + change(e, a, b) + change(f, b, a)
                value = _objective(trial)
                if value < objective:
                    excess, objective = trial, value
                    shard[e], shard[f] = b, a
                    swapped += 1
                    i += 1
                    j += 1
                elif degree[slot[f]] > degree[slot[e]]:  # the likelier cause: the entity with more triples
                    j += 1
                else:
                    i += 1
    if swapped == 0:
        return None
    return shard
