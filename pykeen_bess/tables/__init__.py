"""The entity tables while BESS trains: shard tables, their optimizer, and their column parts.

* :mod:`~pykeen_bess.tables.representation`: :class:`~pykeen_bess.tables.representation.ShardedEmbedding`,
  a PyKEEN representation stored shard by shard in a storage tier (:mod:`pykeen_bess.storage`);
* :mod:`~pykeen_bess.tables.optim`: the optimizer of the shard tables (row-sparse rules of
  :mod:`~pykeen_bess.tables.row_rules`) and ``RowwiseAdagrad``;
* :mod:`~pykeen_bess.tables.encoding`: the encoding partition's column parts and partial scores.
"""
