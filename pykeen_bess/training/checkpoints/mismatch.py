"""What differs between a checkpoint that does not fit and this run (the text of ``CheckpointMismatchError``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...data.sharding import EntitySharding, RandomSharding
from .checkpointed import CheckpointedLoop, checksum, optimizer_text, scheduler_settings, scheduler_text

__all__ = ["describe_mismatch", "legacy_checksum", "predated_checks", "scheduler_difference"]


def _shapes(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state_dict.items() if isinstance(value, torch.Tensor)}


def _hyperparameters(optimizer_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each group's settings, at its initial learning rate where a scheduler recorded one (see ``optimizer_text``)."""
    groups = []
    for group in optimizer_state.get("param_groups", []):
        settings = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
        if "initial_lr" in group:
            settings["lr"] = group["initial_lr"]
        groups.append(settings)
    return groups


def describe_mismatch(loop: CheckpointedLoop, state: Mapping[str, Any], triples_factory: Any = None) -> str:
    """Say what differs between a checkpoint that does not fit and this run, as far as the checkpoint shows it.

    PyKEEN's checksum covers the model's and the optimizer's ``repr`` (of BESS's shard tables: the
    entity sharding). The checkpoint holds the parameters' shapes, the optimizer's settings, the
    labels of the training triples (when they were given) and the model's random seed, but no
    sharding: a sharding that differs is found by trying the shardings of this run's strategy and
    the random one (for the shard counts that fit the checkpoint's table) until one's checksum matches.
    """
    differences: list[str] = []
    theirs, ours = _shapes(state.get("model_state_dict", {})), _shapes(loop.model.state_dict())
    only_theirs, only_ours = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    if only_theirs or only_ours:
        differences.append(
            f"the model's parameters (another model?): only in the checkpoint {only_theirs}, only in this run "
            f"{only_ours}"
        )
    for key in sorted(set(theirs) & set(ours)):
        a, b = theirs[key], ours[key]
        if a == b:
            continue
        what = "embedding dimension" if a[1:] != b[1:] else "rows (number of entities or relations, or of shards)"
        differences.append(f"{key}: {what}: the checkpoint's shape is {list(a)}, this run's {list(b)}")
    if triples_factory is not None:
        for name, labels in (("entity", "entity_to_id"), ("relation", "relation_to_id")):
            written, current = state.get(f"{labels}_dict"), getattr(triples_factory, labels, None)
            if written is not None and current is not None and dict(written) != dict(current):
                differences.append(
                    f"the dataset's {name} labels: the checkpoint has {len(written)} {name}s, this run {len(current)}"
                    + (" (other labels)" if len(written) == len(current) else "")
                )
    groups_theirs = _hyperparameters(state.get("optimizer_state_dict", {}))
    groups_ours = _hyperparameters(loop.optimizer.state_dict()) if loop.optimizer is not None else []
    if len(groups_theirs) != len(groups_ours):
        differences.append(
            f"the optimizer: {len(groups_theirs)} parameter groups in the checkpoint, {len(groups_ours)} in this run"
        )
    changed: dict[str, str] = {}
    for written, current in zip(groups_theirs, groups_ours):
        for name in sorted(set(written) | set(current)):
            if written.get(name) != current.get(name):
                changed.setdefault(name, f"{name}: checkpoint {written.get(name)!r}, this run {current.get(name)!r}")
    if changed:
        another = any(set(a) != set(b) for a, b in zip(groups_theirs, groups_ours))
        kind = " (another optimizer)" if another else ""
        differences.append(f"the optimizer's settings{kind}: {', '.join(changed.values())}")
    scheduler = scheduler_difference(loop, state)
    if scheduler is not None:
        differences.append(scheduler)
    written_sharding = _find_sharding(loop, state)
    if written_sharding is not None:
        differences.append(
            f"the entity sharding: the checkpoint's is {written_sharding[0]}, this run's {loop.sharding.fingerprint} "
            f"({loop.sharding.strategy.describe()}; resume with training_loop_kwargs=dict({written_sharding[1]}))"
        )
    if differences:
        return "What differs: " + "; ".join(differences) + "."
    return (
        f"Its parameter shapes and optimizer settings match this run's; the check also includes the entity sharding "
        f"(this run: {loop.sharding.fingerprint}; a checkpoint file records only a checksum of it, and none of the "
        f"shardings tried matched) and model settings outside the parameters (the loss and its settings, another "
        f"model class with the same parameters, an interaction's norm, ...): resume with the model, loss, "
        f"optimizer, sharding and seed the "
        f"checkpoint was written with (e.g. training_loop_kwargs=dict(sharding='random') for checkpoints written "
        f"before 'balanced' became the default)."
    )


def scheduler_difference(loop: CheckpointedLoop, state: Mapping[str, Any]) -> str | None:
    """Say how the checkpoint's learning-rate scheduler differs from this run's (None: as far as it shows, alike)."""
    written, scheduler = state.get("lr_scheduler_state_dict"), loop.lr_scheduler
    if written is None and scheduler is None:
        return None
    if scheduler is None:
        return "the learning-rate scheduler: the checkpoint was written with one, this run has none"
    if written is None:
        return f"the learning-rate scheduler: the checkpoint has none, this run {type(scheduler).__name__}"
    state = scheduler.state_dict()
    if _public(written) != _public(state):  # a class's state always has the same entries (private ones may vary)
        return f"the learning-rate scheduler: this run has {scheduler_text(scheduler)}, the checkpoint another class"
    theirs, ours = scheduler_settings(written, type(scheduler)), scheduler_settings(state, type(scheduler))
    if theirs == ours:
        return None
    return (
        f"the learning-rate scheduler: this run has {scheduler_text(scheduler)}, the checkpoint's settings are {theirs}"
    )


def _public(state: Mapping[str, Any]) -> set[str]:
    """Return the entries of a scheduler's state but torch's private ones (which torch versions add)."""
    return {key for key in state if not key.startswith("_")}


def legacy_checksum(loop: CheckpointedLoop) -> str:
    """Return the loop's checkpoint checksum as written before the shard tables' ``repr`` named their sharding."""
    model = str(loop.model)
    for table in loop.tables:
        model = model.replace(f"ShardedEmbedding({table.sharding.fingerprint})", "ShardedEmbedding()")
    return checksum(model, optimizer_text(loop.optimizer))


def predated_checks(loop: CheckpointedLoop, state: Mapping[str, Any]) -> str | None:
    """Say which checks a checkpoint was written before, where it fits this run as far as those versions checked.

    - the sharding: written before the checksum named the sharding (then always random), for a random one;
    - the scheduler: written before the checksum covered the learning-rate scheduler, with a state of this
      run's scheduler settings (a checkpoint of another scheduler class with the same settings cannot be
      told apart).

    :returns: the checks (None: the checkpoint does not fit)
    """
    if isinstance(loop.sharding.strategy, RandomSharding) and state.get("checksum") == legacy_checksum(loop):
        return "sharding checks (the sharding was random)"
    if loop.lr_scheduler is None:
        return None
    written = checksum(str(loop.model), optimizer_text(loop.optimizer))  # without the scheduler's text
    if state.get("checksum") == written and scheduler_difference(loop, state) is None:
        return "scheduler checks (its scheduler's settings are this run's)"
    return None


def _find_sharding(loop: CheckpointedLoop, state: Mapping[str, Any]) -> tuple[str, str] | None:
    """Find the sharding whose checksum is the checkpoint's among a few candidates.

    The candidates: this run's shard count and those whose padded table has the checkpoint's number
    of rows (at most four), this run's seed and the checkpoint's random seed, this run's strategy, the
    random and (for this run's training triples) the balanced one.

    :returns: the sharding's description and the loop arguments that build it, None if none matched
    """
    from ...data.sharding import resolve_sharding

    written = state.get("checksum")
    current = loop.sharding
    model, optimizer = str(loop.model), optimizer_text(loop.optimizer)
    if written is None or current.fingerprint not in model:
        return None
    num_entities = current.num_entities
    rows = {
        shape[0]
        for key, shape in _shapes(state.get("model_state_dict", {})).items()
        if key.endswith(".weight") and shape
    }
    others = [
        n for n in range(1, min(num_entities, 1024) + 1) if n != current.n_shard and -(-num_entities // n) * n in rows
    ]
    seeds = list(dict.fromkeys([current.seed, int(state.get("random_seed") or 0)]))
    strategies = {"this": current.strategy, "random": RandomSharding()}
    settings = getattr(loop, "settings", None)
    if settings is not None and settings.schema is None and settings.factory is not None:
        strategies["balanced"] = resolve_sharding("balanced", None, settings.factory)
    for n in [current.n_shard, *others[:4]]:
        for seed in seeds:
            for name, strategy in strategies.items():
                try:
                    candidate = EntitySharding.create(num_entities, n, seed=seed, strategy=strategy)
                except (ValueError, TypeError):
                    continue
                if candidate.fingerprint == current.fingerprint:
                    continue
                candidate_model = model.replace(current.fingerprint, candidate.fingerprint)
                if checksum(candidate_model, optimizer, scheduler_text(loop.lr_scheduler)) != written:
                    continue
                arguments = [f"num_shards={n}"] if n != current.n_shard else []
                arguments += [f"seed={seed}"] if seed != current.seed else []
                arguments += [f"sharding={name!r}"] if name != "this" else []
                return f"{candidate.fingerprint} ({strategy.describe()})", ", ".join(arguments)
    return None
