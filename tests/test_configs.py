"""The shipped configurations (``configs/``) run through the command line (a short run on Nations)."""

from __future__ import annotations

import json
import pathlib

import pytest

from pykeen_bess.cli import load_config, main

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.json"))


def test_there_are_configs() -> None:
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_runs(path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    config = load_config(path)  # a PyKEEN pipeline configuration for BESS
    assert config["model"] and config["training_kwargs"]["num_epochs"] > 0
    code = main(
        ["train", "--config", str(path), "--dataset", "nations", "--epochs", "1", "--dim", "8", "--quiet", "--json"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert 0 < json.loads(captured.out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
