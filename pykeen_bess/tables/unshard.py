"""An ordinary PyKEEN model again: a model's shard tables held whole in this process back in plain embeddings.

A model trained with its tables on the device is written back into its own
:class:`pykeen.nn.Embedding` s when training ends. One trained with tables in host memory or files
keeps its :class:`~pykeen_bess.tables.representation.ShardedEmbedding` s (the tables may not fit
anywhere else, see the storage how-to): it scores, predicts and evaluates, but its ``state_dict`` is
not PyKEEN's, PyKEEN's own loops refuse it, and pickling it saves the table's tier with it.
:func:`unshard_model` reads such tables into the model's embeddings; a new
:class:`~pykeen_bess.training.BessTrainingLoop` given such a model does it first.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..storage.base import check_host_memory, format_bytes
from .other_loops import GuardedReset
from .representation import ShardedEmbedding

__all__ = ["unshard_model"]

logger = logging.getLogger(__name__)


def unshard_model(model: Any) -> Any:
    """Put the rows of a model's shard tables held whole in this process back into plain embeddings, in place.

    Every entity representation that is a :class:`~pykeen_bess.tables.representation.ShardedEmbedding`
    holding all shards is replaced by the :class:`pykeen.nn.Embedding` it was made from (its normalizer,
    regularizer, constrainer, initializer), holding the table's rows in global entity order, on the device
    the embedding was on; the table's optimizer state (the training loop's) is not carried over. Afterwards
    the model is an ordinary PyKEEN model: its ``state_dict`` has PyKEEN's keys, PyKEEN's loops and a new
    BESS loop train it, and ``save_to_directory`` writes its weights only. A model without shard tables is
    returned as it is. The loop that trained the model keeps its own tables: continuing that loop
    (``continue_training=True``) trains those again, not the embeddings.

    :param model: a PyKEEN ``ERModel``, e.g. one a :class:`~pykeen_bess.training.BessTrainingLoop` trained
        with ``storage="host"`` or ``"mmap"``
    :returns: the model
    :raises ValueError: for tables spread over processes (gather them with
        :func:`~pykeen_bess.distributed.export_model`), or column parts of the encoding partition
    :raises MemoryError: if tables kept outside the model do not fit in the available host memory
    """
    representations = getattr(model, "entity_representations", None)
    if representations is None:
        return model
    tables = [(index, r) for index, r in enumerate(representations) if isinstance(r, ShardedEmbedding)]
    if not tables:
        return model
    for _, table in tables:
        if table.column_part is not None:
            raise ValueError(
                "The model's entity tables are column parts (partition='encoding' while training); unshard it after "
                "training, when they are row shards."
            )
        if not table.holds_all_shards:
            raise ValueError(
                "The model's entity tables are spread over processes: no process can hold them whole here. Gather "
                "them with pykeen_bess.distributed.export_model(model, path) (collective) and load that file, or "
                "resume the training's checkpoint."
            )
    outside = [table for _, table in tables if not isinstance(table.weight, nn.Parameter)]
    needed = sum(table.max_id * table.row_width * table.weight.element_size() for table in outside)
    if outside and needed:
        check_host_memory(needed, outside[0].storage.name)
        logger.info("Reading %s of entity tables into the model's embeddings.", format_bytes(needed))
    with torch.no_grad():
        for index, table in tables:
            base = table.base_embedding
            table.copy_to(base)
            representations[index] = base
    if isinstance(vars(model).get("reset_parameters_"), GuardedReset):  # nothing outside the model to guard now
        del model.reset_parameters_
    sharding = tables[0][1].sharding
    if getattr(model, "bess_sharding", None) is None:  # the evaluator's default sharding: the training's
        model.bess_sharding = dict(num_shards=sharding.n_shard, seed=sharding.seed)
    return model
