"""One rank of a distributed evaluation test (started by the shared harness, one process per rank).

The rank holds one shard of a ComplEx model's entity table, evaluates with :class:`BessEvaluator`
and predicts the top k, and writes the results to ``{output}/rank{r}.pt``.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch

from pykeen_bess.distributed import init_from_environment
from pykeen_bess.evaluation import BessEvaluator, predict_top_k
from pykeen_bess.tables.representation import ShardedEmbedding
from pykeen_bess.data.sharding import EntitySharding

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_evaluation import dataset, filter_triples, make_model


def main() -> None:
    output = pathlib.Path(sys.argv[1])
    init_from_environment()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = dataset("nations")
    model = make_model("ComplEx", data)
    embedding = model.entity_representations[0]
    table = ShardedEmbedding(embedding, EntitySharding.create(data.num_entities, world_size, seed=5), [rank])
    table.copy_from(embedding)
    model.entity_representations[0] = table.to(torch.float64)
    result = BessEvaluator(batch_size=50, slice_size=3).evaluate(
        model, data.testing.mapped_triples, additional_filter_triples=filter_triples(data), use_tqdm=False
    )
    top = predict_top_k(model, data.testing.mapped_triples[:20, :2], k=4, filter_triples=data.training.mapped_triples)
    torch.save(dict(metrics=result.to_flat_dict(), tail_ids=top["tail_id"].tolist()), output / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
