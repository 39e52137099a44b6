"""One rank of the collective token lookup tests (started by ``test_token_lookup.py``).

Part 1: a float64 shard table over the ranks; every rank looks up its own ids (a different number
on every rank, one rank none, duplicates) with both variants, through the representation's
``forward``, and backpropagates its own weights. Part 2: a model trained on the ranks is queried
(``score_hrt``, ``score_t``, ``predict_target``, the full entity representation) and exported, so
that the test can compare with the gathered model. Writes ``{output}/rank{r}.pt``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist
from distributed_worker import build_loop, small_factory
from pykeen.nn.representation import Embedding
from pykeen.predict import predict_target

from pykeen_bess.distributed import export_model, init_from_environment, make_topology
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.data.sharding import EntitySharding

NUM_ENTITIES = 23


def request(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids (shape ``[c, 2]``) and backward weights of a rank: 0, 9 or 40 pairs."""
    generator = torch.Generator().manual_seed(100 + rank)
    count = (9, 0, 40)[rank % 3]
    ids = torch.randint(NUM_ENTITIES, (count, 2), generator=generator)
    weights = torch.randn(count, 2, 3, 2, generator=generator, dtype=torch.float64)
    return ids, weights


def full_table() -> torch.Tensor:
    """The full table every rank shards: ``[N, 3, 2]`` (complex vectors as real pairs)."""
    return torch.randn(NUM_ENTITIES, 3, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def table_lookups(rank: int) -> dict:
    """Look up this rank's ids with both variants; return the rows and the table's gradient."""
    topology = make_topology()
    sharding = EntitySharding.create(NUM_ENTITIES, topology.n_shard, seed=3)
    base = Embedding(max_id=NUM_ENTITIES, shape=3, dtype=torch.cfloat).double()  # stored as float64 pairs
    table = ShardedEmbedding(base, sharding, topology.local_shards)
    table.topology = topology
    table.copy_from_tensor(full_table().reshape(NUM_ENTITIES, -1))
    result = dict(entity_rows=table.entity_rows.clone())
    for variant in ("routed", "gathered"):
        ids, weights = request(rank)
        table.weight.grad = None
        table.token_lookup = variant
        before = topology.bytes_sent
        rows = table(indices=ids)  # PyKEEN's forward: complex [c, 2, 3]
        (torch.view_as_real(rows) * weights).sum().backward()
        result[variant] = dict(rows=torch.view_as_real(rows).detach(), grad=table.weight.grad.clone())
        result[variant]["bytes"] = topology.bytes_sent - before
    return result


def model_queries(rank: int, output: pathlib.Path) -> dict:
    """Train a small model on the ranks, query it while it is sharded, and export it."""
    factory, dataset = small_factory(300)
    loop = build_loop(dict(num_negs_per_pos=6), factory)
    loop.train(factory, num_epochs=1, batch_size=18, use_tqdm=False)
    model = loop.model
    triples = dataset.testing.mapped_triples[4 * rank : 9 * rank + 3]  # different on every rank
    with torch.no_grad():
        result = dict(
            triples=triples,
            score_hrt=model.score_hrt(triples).detach(),
            score_t=model.score_t(triples[:, :2]).detach(),
            entities=model.entity_representations[0]().detach(),
        )
    prediction = predict_target(model, head=int(triples[0, 0]), relation=int(triples[0, 1]))
    result["predict_target"] = prediction.df[["tail_id", "score"]].to_dict("list")
    export_model(model, output / "model.pt")
    return result


def main() -> None:
    """Run both parts as this rank."""
    config = json.loads(sys.argv[1])
    output = pathlib.Path(config["output"])
    output.mkdir(parents=True, exist_ok=True)
    init_from_environment()
    rank = dist.get_rank()
    result = dict(table=table_lookups(rank), model=model_queries(rank, output))
    torch.save(result, output / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
