"""The validated settings of a BESS training run, and the checks that run before any work starts.

:class:`BessConfig` is frozen: a run's settings are validated once, when the loop is created
(every error names the parameter and what to do), and all ranks of a process group compare their
run configuration (:meth:`~pykeen_bess.training.parts.LoopParts.run_configuration`) at the start of
training (:func:`verify_same_configuration`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any

from class_resolver import HintOrType, OptionalKwargs
from pykeen.sampling import BasicNegativeSampler, NegativeSampler, negative_sampler_resolver

from ...distributed import Topology, describe_differences
from ...data.sampling import (
    CORRUPTIONS,
    DEFAULT_NEGATIVES,
    BessSampler,
    Corruption,
    StepSharedBessSampler,
    resolve_negatives,
)
from ...schemes import AUTO, ExchangeScheme, resolve_scheme

__all__ = [
    "DEFAULT_NUM_NEGS_PER_POS",
    "PARTITIONS",
    "BessConfig",
    "check_integer",
    "check_positive",
    "check_train_arguments",
    "resolve_negative_sampler",
    "resolve_partition",
    "round_num_negs",
    "verify_same_configuration",
]

logger = logging.getLogger(__name__)

#: the model checks that moved to :mod:`.models`, still importable from here (code written against earlier versions)
_MOVED_TO_MODELS = (
    "SUPPORTED_MODEL_EXAMPLES",
    "UnsupportedModelError",
    "check_model",
    "check_model_dtype",
    "check_one_dtype",
    "check_triples_fit_model",
    "describe_regularizer",
)


def __getattr__(name: str) -> Any:
    """Return a model check that moved to :mod:`.models` (imported lazily: that module needs nothing of this one)."""
    if name in _MOVED_TO_MODELS:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the default number of negatives per positive (rounded up to a multiple of the shard count)
DEFAULT_NUM_NEGS_PER_POS = 64


@dataclasses.dataclass(frozen=True, eq=False)
class BessConfig:
    """The BESS settings of a training loop, validated (see :class:`~pykeen_bess.training.BessTrainingLoop`)."""

    #: the exchange scheme, or None for ``exchange="auto"`` (chosen per block size)
    scheme: type[ExchangeScheme] | None
    #: ``"h"``, ``"t"`` or ``"ht"``
    corruption: Corruption
    #: negatives per positive, a multiple of the number of shards
    num_negs_per_pos: int
    #: the seed of the sharding, the sampler and the initial tables
    seed: int
    #: whether the shard tables are updated row-sparsely
    sparse_updates: bool
    #: bytes a memory probe may use on the CPU (None: half the available memory)
    memory_budget: int | None
    #: how the entity tables are split: ``"token"`` (rows, BESS's shards) or ``"encoding"`` (columns)
    partition: str = "token"
    #: the sampler of balanced batches (``negatives="step"``, the default:
    #: :class:`~pykeen_bess.data.sampling.StepSharedBessSampler`; ``"block"``:
    #: :class:`~pykeen_bess.data.sampling.BessSampler`;
    #: ``"typed_step"``, ``"typed"``: their typed forms; :data:`~pykeen_bess.data.sampling.NEGATIVES`)
    sampler: type[BessSampler] = StepSharedBessSampler

    @classmethod
    def create(
        cls,
        n_shard: int,
        exchange: Any,
        corruption: Any,
        num_negs_per_pos: Any,
        seed: Any,
        sparse_updates: Any,
        memory_budget: Any,
        partition: Any = None,
        negatives: Any = DEFAULT_NEGATIVES,
    ) -> BessConfig:
        """Validate the settings for ``n_shard`` shards.

        :raises ValueError: naming the first invalid setting
        """
        partition, exchange = resolve_partition(partition, exchange)
        scheme = None if exchange == AUTO else resolve_scheme(exchange)
        if corruption not in CORRUPTIONS:
            raise ValueError(f"Unknown corruption={corruption!r}; expected one of {CORRUPTIONS}.")
        if memory_budget is not None:
            memory_budget = check_integer("memory_budget", memory_budget, minimum=1, hint="(bytes) or None")
        if not isinstance(sparse_updates, bool | numbers.Integral) or sparse_updates not in (0, 1):  # not "False"
            raise ValueError(f"sparse_updates must be True or False, not {sparse_updates!r}.")
        return cls(
            scheme=scheme,
            corruption=corruption,
            num_negs_per_pos=check_num_negs(num_negs_per_pos, n_shard),
            seed=check_integer("seed", seed, minimum=0),
            sparse_updates=bool(sparse_updates),
            memory_budget=memory_budget,
            partition=partition,
            sampler=resolve_negatives(negatives),
        )

    @property
    def scheme_name(self) -> str:
        """The name of the scheme (``"auto"`` if it is chosen per block size)."""
        return AUTO if self.scheme is None else self.scheme.get_name()


#: the entity-table partitions: rows (BESS's shards) or columns; each is a strategy of
#: :mod:`~pykeen_bess.training.setup.partitions` (whose resolver holds exactly these names)
PARTITIONS = ("token", "encoding")


def resolve_partition(partition: Any, exchange: Any) -> tuple[str, Any]:
    """Return the partition and the exchange scheme (name or class) of a run, checked against each other.

    ``partition=None`` follows the scheme (``exchange="encoding"`` is the encoding partition);
    ``exchange=None`` is the partition's default scheme (``"embedding"``, or ``"encoding"``, which the encoding
    partition turns into ``"encoding_lookup"`` for interactions that are not column-separable).

    :raises ValueError: for an unknown partition or a scheme of the other partition
    """
    if partition is not None and partition not in PARTITIONS:
        raise ValueError(f"Unknown partition={partition!r}; expected one of {PARTITIONS}.")
    scheme = None if exchange in (None, AUTO) else resolve_scheme(exchange)
    if partition is None:
        partition = scheme.partition if scheme is not None else "token"
    if exchange is None:
        exchange = "encoding" if partition == "encoding" else "embedding"
    if scheme is not None and scheme.partition != partition:
        raise ValueError(
            f"exchange={scheme.get_name()!r} works on the {scheme.partition!r} partition, not partition={partition!r}; "
            f"with partition='encoding' use exchange='encoding', 'encoding_lookup' (or 'auto'), with partition='token' "
            f"'embedding', "
            f"'score' or 'auto'."
        )
    return partition, exchange


def check_integer(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``; else raise an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {expected}{' ' + hint if hint else ''}, but is {value!r}.")
    return int(value)


def check_positive(name: str, value: Any, allow_inf: bool = False) -> float:
    """Return ``value`` as a ``float`` if it is a positive real number (finite unless ``allow_inf``); else raise."""
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if not (number > 0 and (allow_inf or math.isfinite(number))):
        expected = "a positive number or inf" if allow_inf else "a positive finite number"
        raise ValueError(f"{name} must be {expected} (or None), but is {value!r}.")
    return number


def round_num_negs(num_negs_per_pos: Any, n_shard: int, chosen: int | None = None) -> int:
    """Round a tuned ``num_negs_per_pos`` (``train()``, HPO) up to a multiple of the number of shards.

    :param chosen: the value the user gave the loop (None: its default); replacing it by another is logged as a
        warning (``hpo_pipeline`` tunes it as a training argument, over a value given in ``training_loop_kwargs``)
    """
    value = check_integer("num_negs_per_pos", num_negs_per_pos, minimum=1)
    rounded = n_shard * math.ceil(value / n_shard)
    if rounded != value:
        logger.info(
            "num_negs_per_pos=%d rounded up to %d, a multiple of num_shards=%d (every shard contributes equally).",
            value,
            rounded,
            n_shard,
        )
    if chosen is not None and rounded != chosen:
        logger.warning(
            "train(num_negs_per_pos=%d) replaces the loop's num_negs_per_pos=%d (hpo_pipeline tunes it as a "
            "training argument: pin it with training_kwargs=dict(num_negs_per_pos=%d)).",
            value,
            chosen,
            chosen,
        )
    return rounded


def check_num_negs(num_negs_per_pos: Any, n_shard: int) -> int:
    """Return the constructor's ``num_negs_per_pos`` (default 64, rounded up), a multiple of ``n_shard``."""
    if num_negs_per_pos is None:
        return n_shard * math.ceil(DEFAULT_NUM_NEGS_PER_POS / n_shard)
    num_negs_per_pos = check_integer("num_negs_per_pos", num_negs_per_pos, minimum=1)
    if num_negs_per_pos % n_shard:
        raise ValueError(
            f"num_negs_per_pos={num_negs_per_pos} is not usable with num_shards={n_shard}: BESS draws the same number "
            f"of negatives from every shard, so it must be a multiple of num_shards (e.g. "
            f"{n_shard * math.ceil(num_negs_per_pos / n_shard)})."
        )
    return num_negs_per_pos


#: PyKEEN's ``corruption_scheme`` of its basic sampler as the loop's ``corruption``
CORRUPTION_SCHEMES = {frozenset({"head", "tail"}): "ht", frozenset({"head"}): "h", frozenset({"tail"}): "t"}


def resolve_negative_sampler(
    negative_sampler: HintOrType[NegativeSampler],
    negative_sampler_kwargs: OptionalKwargs,
    num_negs_per_pos: int | None,
    corruption: Any = "ht",
) -> int | None:
    """Accept only what is meaningful for BESS from PyKEEN's negative sampler arguments.

    ``num_negs_per_pos`` is used; PyKEEN's "no filtering" (``filtered=False``, ``filterer=None``,
    ``filterer_kwargs=None``) and a ``corruption_scheme`` that is the loop's ``corruption`` are accepted;
    anything else is refused.
    """
    if negative_sampler is not None and negative_sampler_resolver.lookup(negative_sampler) is not BasicNegativeSampler:
        raise ValueError(
            f"BessTrainingLoop draws its own balanced negatives shared within blocks; negative_sampler="
            f"{negative_sampler!r} is not supported. Pass negative_sampler_kwargs=dict(num_negs_per_pos=...) and the "
            f"corruption via training_loop_kwargs=dict(corruption='h'|'t'|'ht')."
        )
    kwargs = dict(negative_sampler_kwargs or {})
    from_sampler = kwargs.pop("num_negs_per_pos", None)
    # PyKEEN's way of saying "no filtering" (its sLCWA defaults and configs pass filterer=None)
    for key in ("filterer", "filterer_kwargs"):
        if key in kwargs and kwargs[key] is None:
            del kwargs[key]
    if "filtered" in kwargs and kwargs["filtered"] is False:
        del kwargs["filtered"]
    if "corruption_scheme" in kwargs:
        scheme = kwargs.pop("corruption_scheme")
        # (None or empty: PyKEEN's default, head and tail)
        sides = frozenset([scheme] if isinstance(scheme, str) else scheme or ("head", "tail"))
        if CORRUPTION_SCHEMES.get(sides, sides) != corruption:
            raise ValueError(
                f"negative_sampler_kwargs=dict(corruption_scheme={scheme!r}) is not this loop's corruption="
                f"{corruption!r}: choose the corrupted sides with training_loop_kwargs=dict(corruption='h'|'t'|'ht')."
            )
    if "filterer" in kwargs:
        raise ValueError(
            f"negative_sampler_kwargs=dict(filterer={kwargs['filterer']!r}) is not supported: BESS does not filter "
            f"false negatives (its negatives are shared within blocks). Leave filterer unset or None."
        )
    if kwargs:
        raise ValueError(
            f"Unsupported negative_sampler_kwargs for BESS: {sorted(kwargs)}. Only num_negs_per_pos is used; choose "
            f"the corrupted side with training_loop_kwargs=dict(corruption=...). Filtering of false negatives is not "
            f"supported."
        )
    if from_sampler is not None and num_negs_per_pos is not None and from_sampler != num_negs_per_pos:
        raise ValueError(
            f"Conflicting num_negs_per_pos: {num_negs_per_pos} and {from_sampler} (negative_sampler_kwargs)."
        )
    return num_negs_per_pos if num_negs_per_pos is not None else from_sampler


def verify_same_configuration(topology: Topology, config: Mapping[str, str]) -> None:
    """Check that all processes run the same configuration (collective; nothing to check in one process).

    :raises ValueError: naming every setting that differs between ranks
    """
    if not topology.is_distributed:
        return
    configs = topology.all_gather_object(dict(config))
    lines = describe_differences(configs)
    if not lines:
        return
    hint = ""
    tuned = ("batch_size", "num_epochs", "num_negs_per_pos", "loss", "regularizers", "optimizer_kwargs", "lr_scheduler")
    if any(f"  {key}:" in lines for key in tuned):
        hint = (
            "\nUnder hpo_pipeline every rank must draw the same trials: give all ranks the same sampler seed, "
            "e.g. hpo_pipeline(..., sampler='random', sampler_kwargs=dict(seed=0))."
        )
    raise ValueError(f"The ranks of the process group run different configurations:\n{lines}{hint}")


def check_train_arguments(
    num_epochs: Any, batch_size: Any, train_kwargs: Mapping[str, Any], has_optimizer: bool
) -> None:
    """Check the arguments of ``BessTrainingLoop.train()`` before any work.

    :raises ValueError: for an invalid number of epochs, batch or sub-batch size, gradient clipping values
        other than positive numbers (a norm's order may be ``inf``), or ``continue_training`` without the
        optimizer (and its state) of the last training
    """
    check_integer("num_epochs", num_epochs, minimum=0)
    if train_kwargs.get("continue_training") and not has_optimizer:
        raise ValueError(
            "Cannot continue_training: the optimizer (and its state) was released after the last training, as "
            "train() and pipeline() do by default (clear_optimizer=True). Train with clear_optimizer=False "
            "(pipeline(..., clear_optimizer=False)) to continue training later."
        )
    if batch_size is not None:
        check_integer("batch_size", batch_size, minimum=1, hint="or None to search the largest that fits")
    if train_kwargs.get("sub_batch_size") is not None:
        check_integer("sub_batch_size", train_kwargs["sub_batch_size"], minimum=1, hint="or None")
    for option, allow_inf in (
        ("gradient_clipping_max_norm", False),
        ("gradient_clipping_max_abs_value", False),
        ("gradient_clipping_norm_type", True),
    ):
        if train_kwargs.get(option) is not None:
            check_positive(option, train_kwargs[option], allow_inf=allow_inf)
