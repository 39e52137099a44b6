"""Stage 8 of the pipeline: sharded evaluation and top-k prediction.

* :mod:`~pykeen_bess.evaluation.rows`: the entity rows of a process' shards (shard tables, or any
  representation through ``forward``);
* :mod:`~pykeen_bess.evaluation.candidates`: the columns of each local shard's candidates and the
  id tables on the device;
* :mod:`~pykeen_bess.evaluation.sharded`: :class:`ShardedScoring`, queries and candidate slices per
  shard on the device, and the masked block loop of top-k prediction;
* :mod:`~pykeen_bess.evaluation.sizes`: the block sizes, by probe when not given;
* :mod:`~pykeen_bess.evaluation.filtering`: :class:`FilterIndex`, the known triples by key;
* :mod:`~pykeen_bess.evaluation.counting`: counting a block, near-ties by PyKEEN's own scores, and
  PyKEEN's ranks from the counts;
* :mod:`~pykeen_bess.evaluation.excluded`: the excluded ``(query, candidate)`` pairs of one target,
  per batch;
* :mod:`~pykeen_bess.evaluation.ranking`: the ranking of each target (the block loop on the device,
  the queries ranked again) and the one copy of all ranks to the host;
* :mod:`~pykeen_bess.evaluation.evaluator`: :class:`BessEvaluator`, PyKEEN's exact rank metrics;
* :mod:`~pykeen_bess.evaluation.prediction`: :func:`predict_top_k`;
* :mod:`~pykeen_bess.evaluation.checks`: input checks.
"""

from .checks import check_triples
from .evaluator import BessEvaluator
from .filtering import FilterIndex
from .prediction import predict_top_k
from .rows import EntityRows, ForwardRows, ShardTableRows
from .sharded import Queries, ScoreBlock, ShardedScoring
from .sizes import choose_block_sizes

__all__ = [
    "BessEvaluator",
    "EntityRows",
    "FilterIndex",
    "ForwardRows",
    "Queries",
    "ScoreBlock",
    "ShardTableRows",
    "ShardedScoring",
    "check_triples",
    "choose_block_sizes",
    "predict_top_k",
]
