"""Stage 7 of the pipeline: training, :class:`BessTrainingLoop` and the parts it is made of.

* :mod:`~pykeen_bess.training.loop` and :mod:`~pykeen_bess.training.parts`: :class:`BessTrainingLoop`,
  which builds its parts (its setup, optimizer, sampler, scheme and step runner) and trains;
  :mod:`~pykeen_bess.training.hooks`: PyKEEN's hooks of the loop;
* :mod:`~pykeen_bess.training.epochs`: the epochs (the loop's ``_train``, PyKEEN's structure with its
  differences named), typed against what they use of the loop (:class:`~.epochs.EpochLoop`), over the
  steps of :mod:`~pykeen_bess.training.epoch_steps`; :mod:`~pykeen_bess.training.training_run`: what a
  run builds before its first epoch (callbacks, step sizes, batches, steps);
* :mod:`pykeen_bess.training.setup`: the validated settings of a run, the checks before any work, the
  partitions as strategies, block sizes, and the set-up assembled from them;
* :mod:`pykeen_bess.training.steps`: the step of fixed shapes (a GPU replays it as one CUDA graph),
  its plan on the device, its updates, and the executors that run it;
* :mod:`pykeen_bess.training.checkpoints`: checkpoint stores, their files and resharding.

The table sets a run trains (shard tables, column parts) are in :mod:`pykeen_bess.tables`.
"""

from .setup.config import BessConfig
from .setup.models import SUPPORTED_MODEL_EXAMPLES, UnsupportedModelError
from .loop import BessTrainingLoop

__all__ = [
    "SUPPORTED_MODEL_EXAMPLES",
    "BessConfig",
    "BessTrainingLoop",
    "UnsupportedModelError",
]
