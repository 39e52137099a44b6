"""PyTorch-BigGraph's data model and files for PyKEEN: typed graphs, PBG inputs and checkpoints in and out.

PyTorch-BigGraph (PBG) organises a graph by *entity types* (each split into *partitions*) and
*relation types* (each with a left-hand and a right-hand entity type); its files are the lingua
franca of partitioned graph embedding. This subpackage brings them to PyKEEN::

    from pykeen.pipeline import pipeline
    from pykeen_bess import pbg

    graph = pbg.read("pbg_data/", config="config.json")   # types, partitions, relations, edge paths
    result = pipeline(
        training=graph.training, testing=graph.testing, model="DistMult",
        training_loop="bess", training_loop_kwargs=dict(num_shards=4, negatives="typed"),
    )
    pbg.write_checkpoint(result.model, graph, "pbg_ckpt/", training_loop=result.training_loop)

* :mod:`~pykeen_bess.pbg.schema`: :class:`GraphSchema` (types, partitions, relation types), carried
  in the metadata of PyKEEN's own triples factories (one id space, laid out type by type,
  partition by partition);
* :mod:`~pykeen_bess.pbg.graph`: :class:`TypedGraph`, the splits of a typed graph;
* :mod:`~pykeen_bess.pbg.inputs`: :func:`read` / :func:`write` of PBG 1.0 input directories (and
  the pre-release layout, :mod:`~pykeen_bess.pbg.legacy`);
* :mod:`~pykeen_bess.pbg.tsv`: fast import of label TSV files (vectorised factorisation);
* :mod:`~pykeen_bess.pbg.conversion`: exact score conversions (DistMult, TransE p = 2, ComplEx,
  RotatE, RESCAL);
* :mod:`~pykeen_bess.pbg.checkpoint`: :func:`write_checkpoint`; :mod:`~pykeen_bess.pbg.restore`:
  :func:`read_checkpoint`, :func:`initial_model` (a checkpoint as initializers);
* :mod:`~pykeen_bess.pbg.files` and :mod:`~pykeen_bess.pbg.config`: the files and configs themselves.

The BESS training loop reads the schema from the training factory: every shard holds an equal
share of every entity type (with as many shards as partitions, shard ``k`` is partition ``k``),
``negatives="typed"`` draws each relation's negatives from the corrupted side's type
(``"typed_step"``: one such set shared by all blocks of a step, as PBG shares negatives in a chunk), the
relations' loss ``weight`` weighs their positives (unless a ``loss_weighter`` is given), and
``checkpoint_format="pbg"`` writes PBG-layout checkpoints during training.
"""

from .checkpoint import write_checkpoint
from .config import load_config, write_config
from .conversion import conversion_for_model, conversion_for_operator
from .graph import TypedGraph
from .inputs import graph_config, read, write
from .restore import initial_model, read_checkpoint
from .schema import GraphSchema, schema_of
from .tsv import import_tsv

__all__ = [
    "GraphSchema",
    "TypedGraph",
    "conversion_for_model",
    "conversion_for_operator",
    "graph_config",
    "import_tsv",
    "initial_model",
    "load_config",
    "read",
    "read_checkpoint",
    "schema_of",
    "write",
    "write_checkpoint",
    "write_config",
]
