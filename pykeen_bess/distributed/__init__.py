"""Processes: the process topology and everything about running as several processes.

* :mod:`~pykeen_bess.distributed.topology`: :class:`Topology` (which shards a process holds, and
  every collective between processes) with its back ends :class:`LocalTopology` (``n`` logical
  shards in one process), :class:`DistributedTopology` (:mod:`~pykeen_bess.distributed.process_group`:
  one shard per rank of a ``torch.distributed`` group, each shard optionally held by several
  replicas; :class:`ColumnTopology`: one column part of every row per rank, the encoding
  partition) and :class:`ProbeTopology` (no communication, for memory probes), chosen by
  :func:`make_topology`. Together with :mod:`~pykeen_bess.distributed.launch` they are the only
  code that calls ``torch.distributed``; the training loop, the exchange schemes and the evaluator
  are written once against it.
* :mod:`~pykeen_bess.distributed.groups`: :class:`RankLayout`, which rank holds which shard and
  replica (the replica groupings ``none``, ``all``, ``consecutive``, ``orthogonal``).
* :mod:`~pykeen_bess.distributed.launch`: joining the group ``torchrun`` describes.
* :mod:`~pykeen_bess.distributed.export`: gathering a sharded model to save it.
* :mod:`~pykeen_bess.distributed.harness`: starting several ranks on one machine (tests, benchmarks).
"""

from .export import export_model, gathered_model, save_to_directory, writer_topology
from .launch import default_timeout, in_torchrun, init_from_environment, is_main_process, join_torchrun_group
from .groups import GROUPINGS, RankLayout, describe_differences
from .process_group import ColumnTopology, DistributedTopology
from .factory import ProcessGroupHint, make_topology
from .topology import LocalTopology, ProbeTopology, Topology

__all__ = [
    "ProcessGroupHint",
    "GROUPINGS",
    "ColumnTopology",
    "DistributedTopology",
    "LocalTopology",
    "ProbeTopology",
    "RankLayout",
    "Topology",
    "default_timeout",
    "describe_differences",
    "export_model",
    "gathered_model",
    "in_torchrun",
    "init_from_environment",
    "is_main_process",
    "join_torchrun_group",
    "make_topology",
    "save_to_directory",
    "writer_topology",
]
