"""The set-up of a training run: validated settings, checks before any work, and the parts built from them.

* :mod:`~pykeen_bess.training.setup.config`: the validated, frozen settings of a run (``BessConfig``)
  and the checks that run before any work starts (models, sizes, seeds, triples), and the comparison
  of all ranks' settings at the start of training;
* :mod:`~pykeen_bess.training.setup.arguments`: the loop's arguments (``LoopSettings``), and
  :mod:`~pykeen_bess.training.setup.settings`: the immutable ``TrainingSetup`` that
  :mod:`~pykeen_bess.training.setup.assembly` builds from them for a partition;
* :mod:`~pykeen_bess.training.setup.partitions`: the token (rows) and encoding (columns) partitions as
  strategies: what differs between them when a run is assembled;
* :mod:`~pykeen_bess.training.setup.sizes`: block sizes and the automatic memory search.
"""
