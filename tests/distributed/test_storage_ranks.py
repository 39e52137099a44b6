"""Storage tiers under a process group: each rank keeps its shard in host memory or files, bitwise as on the device."""

from __future__ import annotations

import pytest
import torch
from test_distributed import BASE, assemble, check_equals_local_reference, run_launch

TIERS = ["device", "host", "mmap"]


@pytest.mark.slow
def test_two_gloo_ranks_train_bitwise_alike_on_every_tier(tmp_path) -> None:
    """Under a process group each rank keeps its shard in its tier; every step's tables and state are bitwise equal."""
    storage_path = tmp_path / "tables"
    storage_path.mkdir()
    base = dict(BASE, batch_size=16, digests=True, evaluate=True)
    runs = {}
    optimizers = (("adam", "embedding"), ("rowwise_adagrad", "score"), ("adagrad", "score"), ("sgd", "embedding"))
    for optimizer, exchange in optimizers:
        for tier in TIERS:
            extra = dict(storage_path=str(storage_path), storage_kwargs=dict(overwrite=True)) if tier == "mmap" else {}
            if optimizer == "adam":  # also: top-k prediction and the export of the sharded model
                extra.update(predict=True, export=True)
            runs[f"{optimizer}-{tier}"] = dict(base, optimizer=optimizer, exchange=exchange, storage=tier, **extra)
    # checkpoints: one epoch with a checkpoint, then a run to two epochs that resumes it (each rank copies its files)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    resume = dict(
        base,
        optimizer="adam",
        storage="mmap",
        storage_path=str(storage_path),
        storage_kwargs=dict(overwrite=True),
        checkpoint_directory=str(checkpoints),
        checkpoint_name="run.pt",
    )
    runs["checkpoint"] = dict(resume, num_epochs=1)
    runs["resume"] = dict(resume, num_epochs=2)
    # resharding: the two-shard checkpoint (epoch 2) loaded as one shard with two replicas (nothing left to train)
    runs["reshard"] = dict(resume, num_epochs=2, num_shards=1, replicas=2)
    results = run_launch(2, tmp_path / "out", runs, timeout=600)
    full_table = assemble(results["resume"], 14)
    for rank in range(2):
        assert results["reshard"][rank]["step_losses"] == []
        rows = results["reshard"][rank]["global_ids"]
        torch.testing.assert_close(results["reshard"][rank]["table"][rows >= 0], full_table[rows[rows >= 0]])
        for key in ("exp_avg", "exp_avg_sq"):  # the optimizer's row state moved with the rows
            state = assemble([dict(r, table=r["optimizer_state"][key]) for r in results["resume"]], 14)
            torch.testing.assert_close(
                results["reshard"][rank]["optimizer_state"][key][rows >= 0], state[rows[rows >= 0]]
            )
    for rank in range(2):
        full, first, rest = (results[name][rank]["step_losses"] for name in ("adam-device", "checkpoint", "resume"))
        assert first + rest == full
        assert results["resume"][rank]["digests"] == results["adam-device"][rank]["digests"][len(first) :]
    names = sorted(p.name for p in checkpoints.iterdir())
    assert len([n for n in names if ".tables-" in n]) == 2 and "run.pt" in names  # the last version, per rank
    assert not [n for n in names if ".tmp-" in n]  # the kept copies are not named like disposable files
    out = tmp_path / "out"
    exported = {tier: torch.load(out / f"adam-{tier}" / "model.pt", weights_only=False) for tier in TIERS}
    for tier in ("host", "mmap"):
        for rank in range(2):
            assert results[f"adam-{tier}"][rank]["top_k"] == results["adam-device"][rank]["top_k"]
        for ours, reference in zip(exported[tier].parameters(), exported["device"].parameters()):
            assert torch.equal(ours, reference)
        assert exported[tier].entity_representations[0]._embeddings.weight.shape[0] == 14  # a full, ordinary model
    for optimizer, _ in optimizers:
        device = results[f"{optimizer}-device"]
        for tier in ("host", "mmap"):
            stored = results[f"{optimizer}-{tier}"]
            for rank in range(2):
                # every step's tables and state (a tier outside the model allocates its state before the first
                # step, the device tier at it: the digests taken before the first update differ by those zeros)
                assert stored[rank]["digests"][1:] == device[rank]["digests"][1:], (optimizer, tier, rank)
                assert len(stored[rank]["digests"]) > 4
                assert stored[rank]["step_losses"] == device[rank]["step_losses"]
                assert stored[rank]["metrics"] == device[rank]["metrics"]
                assert torch.equal(stored[rank]["table"], device[rank]["table"])
                assert stored[rank]["entity_parameter_numel"] == 0  # not a parameter of the model
        check_equals_local_reference(device, runs[f"{optimizer}-device"], 2)
