"""Checkpoints of a training run: the stores, their files, resharding and PyTorch-BigGraph's layout.

* :mod:`~pykeen_bess.training.checkpoints.stores`: checkpoint stores (one atomic file, or versioned
  rank files with resharding), which see the loop through
  :mod:`~pykeen_bess.training.checkpoints.checkpointed`;
* :mod:`~pykeen_bess.training.checkpoints.files`: versions, pointer files and verified loading;
  :mod:`~pykeen_bess.training.checkpoints.resharding`: rank files read at another shard count;
* :mod:`~pykeen_bess.training.checkpoints.mismatch`: what differs between a checkpoint and the run
  that resumes it;
* :mod:`~pykeen_bess.training.checkpoints.pbg`: checkpoints in PyTorch-BigGraph's layout.

The stores' names are importable from this package as from its former module of the same name.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """Names of the former module ``pykeen_bess.training.checkpoints``: the stores' (imported when asked for)."""
    from . import stores

    try:
        return getattr(stores, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
