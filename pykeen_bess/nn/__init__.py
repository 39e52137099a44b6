"""What pykeen-bess adds to PyKEEN's model zoo: interactions, models and losses, registered as PyKEEN plugins.

* :mod:`~pykeen_bess.nn.interactions`: ``InterHTInteraction`` and ``TranSInteraction``;
* :mod:`~pykeen_bess.nn.models`: ``InterHT`` and ``TranS`` on top of them;
* :mod:`~pykeen_bess.nn.loss`: BESS's block scores under PyKEEN's losses, the weighted NSSA loss
  and the subsampling loss weighter.
"""
