"""The entity tables while BESS trains: shard tables, their optimizer, and their column parts.

* :mod:`~pykeen_bess.tables.representation`: :class:`~pykeen_bess.tables.representation.ShardedEmbedding`,
  a PyKEEN representation stored shard by shard in a storage tier (:mod:`pykeen_bess.storage`);
* :mod:`~pykeen_bess.tables.optim`: the optimizer of the shard tables (row-sparse rules of
  :mod:`~pykeen_bess.tables.row_rules`) and ``RowwiseAdagrad``;
* :mod:`~pykeen_bess.tables.encoding`: the encoding partition's column parts and partial scores;
* :mod:`~pykeen_bess.tables.shard_tables`: the model's entity embeddings as the shard tables of a
  training run (written back afterwards in one process, kept sharded under a process group), created
  and installed by :mod:`~pykeen_bess.tables.creation` after their memory plan
  (:mod:`~pykeen_bess.tables.memory_plan`) is checked;
* :mod:`~pykeen_bess.tables.column_tables`: the encoding partition's table set (one column part per
  rank), whose rows :mod:`~pykeen_bess.tables.lent_rows` lends to row shards.
"""
