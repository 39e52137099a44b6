"""Stage 7 of the pipeline: training, :class:`BessTrainingLoop` and the parts it is made of.

* :mod:`~pykeen_bess.training.config`: the validated, frozen settings of a run and the checks that
  run before any work starts (models, sizes, seeds, triples), and the comparison of all ranks'
  settings at the start of training;
* :mod:`~pykeen_bess.training.settings`: the loop's arguments (``LoopSettings``) and the immutable
  ``TrainingSetup`` that :mod:`~pykeen_bess.training.assembly` builds from them for a partition;
* :mod:`~pykeen_bess.training.partitions`: the token (rows) and encoding (columns) partitions as
  strategies: what differs between them when a run is assembled;
* :mod:`~pykeen_bess.training.tables`: the model's entity embeddings as shard tables while training
  (written back afterwards in one process, kept sharded under a process group);
* :mod:`~pykeen_bess.training.step`: one step (forward and backward over sub-batches, the gradient
  hand-off, the replicated reduction) and the optimizer step composed of training callbacks
  (global-norm clipping): the eager step;
* :mod:`~pykeen_bess.training.static_step`: the static step of fixed shapes a GPU replays as one CUDA
  graph, over the device-side plan (:mod:`~pykeen_bess.training.static_plan`) and the optimizer's
  updates on the device (:mod:`~pykeen_bess.training.static_update`, their rules in
  :mod:`~pykeen_bess.training.static_rules`; on the CPU the distinct rows' updates in
  :mod:`~pykeen_bess.training.host_rows`);
* :mod:`~pykeen_bess.training.sizes`: block sizes and the automatic memory search;
* :mod:`~pykeen_bess.training.checkpoints`: checkpoint stores (one atomic file, or versioned rank
  files with resharding), which see the loop through :mod:`~pykeen_bess.training.checkpointed`;
* :mod:`~pykeen_bess.training.epochs`: the epochs (the loop's ``_train``, PyKEEN's structure with its
  differences named), over the eager and static steps of :mod:`~pykeen_bess.training.epoch_steps`;
* :mod:`~pykeen_bess.training.parts` and :mod:`~pykeen_bess.training.loop`: :class:`BessTrainingLoop`,
  which builds them (its setup, optimizer, sampler, scheme and step runner) and trains.
"""

from .config import SUPPORTED_MODEL_EXAMPLES, BessConfig, UnsupportedModelError
from .loop import BessTrainingLoop

__all__ = [
    "SUPPORTED_MODEL_EXAMPLES",
    "BessConfig",
    "BessTrainingLoop",
    "UnsupportedModelError",
]
