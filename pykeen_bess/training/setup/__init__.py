"""The set-up of a training run: validated settings, checks before any work, and the parts built from them.

* :mod:`~pykeen_bess.training.setup.config`: the validated, frozen settings of a run (``BessConfig``)
  and the checks of its arguments that run before any work starts (sizes, seeds, negatives), and the
  comparison of all ranks' settings at the start of training;
* :mod:`~pykeen_bess.training.setup.models`: what BESS can train of a model (its entity tables,
  regularizers, constrainers, dtypes), and whether the training triples fit it;
* :mod:`~pykeen_bess.training.setup.arguments`: the loop's arguments (``LoopSettings``), and
  :mod:`~pykeen_bess.training.setup.settings`: the immutable ``TrainingSetup`` that
  :mod:`~pykeen_bess.training.setup.assembly` builds from them for a partition;
* :mod:`~pykeen_bess.training.setup.partitions`: the token (rows) and encoding (columns) partitions as
  strategies: what differs between them when a run is assembled;
* :mod:`~pykeen_bess.training.setup.sizes`: block sizes and the automatic memory search.
"""
