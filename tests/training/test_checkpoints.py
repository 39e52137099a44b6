"""Distributed checkpoint files: what PyKEEN reads from the pointer before the loop loads it."""

from __future__ import annotations

import pathlib

import torch
from pykeen.stoppers import EarlyStopper

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.training.checkpoint_files import read_pointer, save_distributed_checkpoint


def test_the_pointer_holds_what_pipeline_and_stoppers_read(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run.pt"
    stopper_dict = dict(best_epoch=3, best_metric=0.5, remaining_patience=2)

    def write(file: pathlib.Path) -> None:
        torch.save({"epoch": 4}, file)

    save_distributed_checkpoint(
        path, LocalTopology(1), write, epoch=4, seed=5, random_seed=123, stopper_dict=stopper_dict
    )
    # pipeline()'s _handle_random_seed and EarlyStopper read these two keys of the file named checkpoint_name
    assert torch.load(path, weights_only=False)["random_seed"] == 123
    assert EarlyStopper.load_summary_dict_from_training_loop_checkpoint(path) == stopper_dict
    assert read_pointer(path)["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt", "run.pt.v1.rank0-of-1"]


def test_a_single_process_refuses_a_distributed_checkpoint_through_pipeline(tmp_path: pathlib.Path) -> None:
    """pipeline() reads the pointer's random seed, then the loop explains instead of failing with a KeyError."""
    import pytest
    from pykeen.pipeline import pipeline

    save_distributed_checkpoint(
        tmp_path / "run.pt",
        LocalTopology(1),
        lambda file: torch.save({"epoch": 1}, file),
        epoch=1,
        seed=0,
        random_seed=7,
    )
    with pytest.raises(ValueError, match="is a checkpoint of a torch.distributed run"):
        pipeline(
            dataset="nations",
            model="DistMult",
            training_loop="bess",
            training_kwargs=dict(
                num_epochs=1, checkpoint_directory=str(tmp_path), checkpoint_name="run.pt", use_tqdm=False
            ),
        )
