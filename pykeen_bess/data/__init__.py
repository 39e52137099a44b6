"""Stages 1-3 of the pipeline: sharding the entities, partitioning the triples, drawing batches and negatives.

* :mod:`~pykeen_bess.data.sharding`: :class:`~pykeen_bess.data.sharding.EntitySharding`, which entity
  lives in which shard (balanced by :mod:`~pykeen_bess.data.balancing`, random, or by type);
* :mod:`~pykeen_bess.data.partition`: the training triples grouped by shardpair;
* :mod:`~pykeen_bess.data.sampling`: balanced batches of ``n ** 2`` blocks and their negatives,
  drawn reproducibly from :mod:`~pykeen_bess.data.seeds`, as :mod:`~pykeen_bess.data.batch` tensors.
"""
