"""Registration in PyKEEN's resolvers, with and without ``import pykeen_bess`` (fresh interpreters)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

CHECK_ALL = """
from pykeen.training import training_loop_resolver
from pykeen.evaluation import evaluator_resolver
from pykeen.nn.modules import interaction_resolver
from pykeen.models import model_resolver
import pykeen_bess.training, pykeen_bess.evaluation, pykeen_bess.interactions, pykeen_bess.models
assert training_loop_resolver.lookup("bess") is pykeen_bess.training.BessTrainingLoop
assert evaluator_resolver.lookup("bess") is pykeen_bess.evaluation.BessEvaluator
assert interaction_resolver.lookup("interht") is pykeen_bess.interactions.InterHTInteraction
assert interaction_resolver.lookup("trans") is pykeen_bess.interactions.TranSInteraction
assert model_resolver.lookup("interht") is pykeen_bess.models.InterHT
assert model_resolver.lookup("trans") is pykeen_bess.models.TranS
print("OK")
"""


def run_python(code: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter; fail with its output if it fails."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


@pytest.mark.parametrize(
    "first_import",
    [
        "import pykeen_bess",
        "import pykeen_bess.training",
        # without importing the plugin: PyKEEN's `pykeen.datasets` entry point installs the hook
        "from pykeen.pipeline import pipeline",
        "from pykeen.training import SLCWATrainingLoop\nfrom pykeen.pipeline import pipeline",
        "from pykeen.hpo import hpo_pipeline",
        "from pykeen.models import model_resolver",
        "from pykeen.evaluation import evaluator_resolver",
        "from pykeen.nn.modules import interaction_resolver",
        "from pykeen.datasets import Nations",
    ],
)
def test_registered_after_import(first_import: str) -> None:
    result = run_python(first_import + "\n" + CHECK_ALL)
    assert "OK" in result.stdout
    assert "could not" not in result.stderr


def test_training_first_needs_explicit_import() -> None:
    """The documented exception: ``pykeen.training`` as the first PyKEEN import needs ``import pykeen_bess``.

    The entry point runs in the middle of that import, and no PyKEEN module finishes loading after
    it, so the hook has nothing to wait for.
    """
    code = "from pykeen.training import training_loop_resolver\nprint('bess' in training_loop_resolver.lookup_dict)"
    assert run_python(code).stdout.strip() == "False"
    run_python("from pykeen.training import training_loop_resolver\nimport pykeen_bess\n" + CHECK_ALL)


def test_registration_is_idempotent() -> None:
    code = """
    import importlib
    import pykeen_bess
    from pykeen_bess.registration import register
    register(); register()
    importlib.reload(pykeen_bess)
    """
    run_python(textwrap.dedent(code) + CHECK_ALL)


PIPELINE_CONFIG = dict(
    dataset="nations",
    model="DistMult",
    model_kwargs=dict(embedding_dim=8),
    training_loop="bess",
    training_loop_kwargs=dict(num_shards=2),
    negative_sampler_kwargs=dict(num_negs_per_pos=4),
    training_kwargs=dict(num_epochs=1, batch_size=128, use_tqdm=False),
    evaluator="bess",
    evaluation_kwargs=dict(use_tqdm=False),
    random_seed=0,
)


def test_pipeline_and_config_without_import() -> None:
    run_python(
        f"""
        from pykeen.pipeline import pipeline, pipeline_from_config
        config = {PIPELINE_CONFIG!r}
        result = pipeline(**config)
        assert type(result.training_loop).__name__ == "BessTrainingLoop"
        result = pipeline_from_config(dict(metadata=dict(title="bess"), pipeline=config))
        assert 0 < result.get_metric("mrr") <= 1
        """
    )


def test_hpo_pipeline_without_import() -> None:
    run_python(
        """
        from pykeen.hpo import hpo_pipeline
        result = hpo_pipeline(
            dataset="nations", model="DistMult", model_kwargs=dict(embedding_dim=8),
            training_loop="bess", training_loop_kwargs=dict(num_shards=2), evaluator="bess",
            training_kwargs=dict(num_epochs=1, use_tqdm=False),
            training_kwargs_ranges=dict(batch_size=dict(type=int, low=6, high=7, scale="power_two"),
                                        num_negs_per_pos=dict(type=int, low=1, high=2, scale="power_two")),
            evaluation_kwargs=dict(use_tqdm=False), n_trials=2,
        )
        trials = result.study.trials
        assert len(trials) == 2 and all(t.state.name == "COMPLETE" for t in trials), trials
        assert all("training.num_negs_per_pos" in t.params for t in trials), trials[0].params
        """
    )


def test_pykeen_command_line_without_import(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "bess.json"
    config.write_text(json.dumps(dict(metadata=dict(title="bess"), pipeline=PIPELINE_CONFIG)))
    result = subprocess.run(
        [sys.executable, "-m", "pykeen", "experiments", "run", str(config), "-d", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert any((tmp_path / "out").rglob("results.json"))


def test_plugin_command_line(tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pykeen_bess",
            "train",
            "--dataset",
            "nations",
            "--num-shards",
            "2",
            "--epochs",
            "2",
            "--quiet",
            "--json",
            "--output",
            str(tmp_path / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert 0 < metrics["both.realistic.inverse_harmonic_mean_rank"] <= 1
    assert (tmp_path / "model" / "trained_model.pkl").is_file()
