"""Registration in PyKEEN's resolvers, with and without ``import pykeen_bess`` (fresh interpreters)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # fresh interpreters

CHECK_ALL = """
from pykeen.training import training_loop_resolver
from pykeen.evaluation import evaluator_resolver
from pykeen.nn.modules import interaction_resolver
from pykeen.models import model_resolver
from pykeen.optimizers import optimizer_resolver
from pykeen.losses import loss_resolver
from pykeen.triples.weights import loss_weighter_resolver
import pykeen_bess.training, pykeen_bess.evaluation, pykeen_bess.nn.interactions, pykeen_bess.nn.models
import pykeen_bess.tables.optim
import pykeen_bess.nn.loss
assert training_loop_resolver.lookup("bess") is pykeen_bess.training.BessTrainingLoop
assert evaluator_resolver.lookup("bess") is pykeen_bess.evaluation.BessEvaluator
assert interaction_resolver.lookup("interht") is pykeen_bess.nn.interactions.InterHTInteraction
assert interaction_resolver.lookup("trans") is pykeen_bess.nn.interactions.TranSInteraction
assert model_resolver.lookup("interht") is pykeen_bess.nn.models.InterHT
assert model_resolver.lookup("trans") is pykeen_bess.nn.models.TranS
assert optimizer_resolver.lookup("rowwise_adagrad") is pykeen_bess.tables.optim.RowwiseAdagrad
assert loss_resolver.lookup("weightednssa") is pykeen_bess.nn.loss.WeightedNSSALoss
assert loss_weighter_resolver.lookup("subsampling") is pykeen_bess.nn.loss.SubsamplingLossWeighter
print("OK")
"""


def run_python(code: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter; fail with its output if it fails."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


#: what each lookup must return: (module, resolver, key, plugin module, class)
LOOKUPS = [
    ("pykeen.training", "training_loop_resolver", "bess", "pykeen_bess.training", "BessTrainingLoop"),
    ("pykeen.evaluation", "evaluator_resolver", "bess", "pykeen_bess.evaluation", "BessEvaluator"),
    ("pykeen.nn.modules", "interaction_resolver", "interht", "pykeen_bess.nn.interactions", "InterHTInteraction"),
    ("pykeen.nn.modules", "interaction_resolver", "trans", "pykeen_bess.nn.interactions", "TranSInteraction"),
    ("pykeen.models", "model_resolver", "interht", "pykeen_bess.nn.models", "InterHT"),
    ("pykeen.models", "model_resolver", "trans", "pykeen_bess.nn.models", "TranS"),
]
#: importing ``pykeen.optimizers``, ``pykeen.losses`` or ``pykeen.triples.weights`` alone loads no entry point:
#: checked after the others (see the README)
LAST_LOOKUPS = [
    ("pykeen.optimizers", "optimizer_resolver", "rowwise_adagrad", "pykeen_bess.tables.optim", "RowwiseAdagrad"),
    ("pykeen.losses", "loss_resolver", "weightednssa", "pykeen_bess.nn.loss", "WeightedNSSALoss"),
    (
        "pykeen.triples.weights",
        "loss_weighter_resolver",
        "subsampling",
        "pykeen_bess.nn.loss",
        "SubsamplingLossWeighter",
    ),
]


def lookup_program(first_import: str, rotation: int) -> str:
    """A program that imports something first, then looks up the plugin in each resolver.

    Each resolver's module is imported right before its lookup (no other PyKEEN import in between),
    and the order of the lookups is rotated so that each resolver is the first one looked up.
    """
    lines = [first_import, "import importlib"]
    for module, resolver, key, plugin_module, cls in [*LOOKUPS[rotation:], *LOOKUPS[:rotation], *LAST_LOOKUPS]:
        lines += [
            f"found = importlib.import_module({module!r}).{resolver}.lookup({key!r})",
            f"assert found is getattr(importlib.import_module({plugin_module!r}), {cls!r}), found",
        ]
    lines.append("print('OK')")
    return "\n".join(lines)


def first_imports() -> list[str]:
    """Every top-level PyKEEN module (and package) as a program's first import, and some import orders."""
    import pkgutil

    import pykeen

    names = sorted(m.name for m in pkgutil.iter_modules(pykeen.__path__) if m.name != "__main__")
    return [
        "import pykeen",
        *(f"import pykeen.{name}" for name in names),
        # the plugin first
        "import pykeen_bess",
        "import pykeen_bess.training",
        # without importing the plugin: PyKEEN's `pykeen.datasets` entry point installs the hook
        "from pykeen.pipeline import pipeline",
        "from pykeen.training import SLCWATrainingLoop\nfrom pykeen.pipeline import pipeline",
        "from pykeen.hpo import hpo_pipeline",
        "from pykeen.models import model_resolver",
        "from pykeen.evaluation import evaluator_resolver",
        "from pykeen.nn.modules import interaction_resolver",
        "from pykeen.training import training_loop_resolver",
        "from pykeen.datasets import Nations",
    ]


def test_registered_whatever_is_imported_first() -> None:
    """Every lookup finds the plugin after any first PyKEEN import.

    Each program runs in a child forked from an interpreter that has loaded PyKEEN's dependencies (torch,
    pandas, ...) but no module of PyKEEN or of the plugin (:mod:`forked_programs`): the first PyKEEN
    import of every program is its own, at a second each instead of a fresh interpreter's five.
    """
    firsts = first_imports()
    programs = [lookup_program(first, index % len(LOOKUPS)) for index, first in enumerate(firsts)]
    driver = pathlib.Path(__file__).parent / "forked_programs.py"
    result = subprocess.run(
        [sys.executable, str(driver)], input=json.dumps(programs), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    failures = [
        f"{first!r}:\n{outcome['output'][-1500:]}"
        for first, outcome in zip(firsts, outcomes)
        if outcome["status"] != 0 or "OK" not in outcome["output"] or "could not" in outcome["output"]
    ]
    assert len(firsts) > 35 and len(outcomes) == len(firsts)
    assert not failures, "\n\n".join(failures)


def test_a_forked_program_that_fails_is_reported() -> None:
    """The forked runner reports a failing program's status and output (the check above can fail)."""
    driver = pathlib.Path(__file__).parent / "forked_programs.py"
    programs = ["print('fine')", "import pykeen.training\nraise ValueError('broken')"]
    result = subprocess.run(
        [sys.executable, str(driver)], input=json.dumps(programs), capture_output=True, text=True, timeout=600
    )
    fine, broken = json.loads(result.stdout.strip().splitlines()[-1])
    assert (fine["status"], fine["output"]) == (0, "fine\n")
    assert broken["status"] == 1 and "ValueError: broken" in broken["output"]


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
