"""Registration in PyKEEN's resolvers, with and without ``import pykeen_bess``, in processes started without PyKEEN."""

from __future__ import annotations

import json
import pathlib

import pytest

pytestmark = pytest.mark.slow  # other processes

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
    from forked_programs import run_chains

    firsts = first_imports()
    outcomes = run_chains([[dict(code=lookup_program(first, i % len(LOOKUPS)))] for i, first in enumerate(firsts)])
    failures = [
        f"{first!r}:\n{outcome['stderr'][-1500:]}"
        for first, (outcome,) in zip(firsts, outcomes)
        if outcome["status"] != 0 or "OK" not in outcome["stdout"] or "could not" in outcome["stderr"]
    ]
    assert len(firsts) > 35 and len(outcomes) == len(firsts)
    assert not failures, "\n\n".join(failures)


def test_forked_programs_report_statuses_and_output(tmp_path: pathlib.Path) -> None:
    """The forked runner runs a chain's steps in order, in their folder, and reports failures (the check can fail)."""
    from forked_programs import run_chains

    chains = [
        [
            dict(code="open('a.txt', 'w').write('x')", cwd=str(tmp_path)),
            dict(code="print(open('a.txt').read())", cwd=str(tmp_path)),
        ],
        [dict(code="import pykeen.training\nraise ValueError('broken')"), dict(module="json.tool", argv=["--help"])],
    ]
    (written, read), (broken, module) = run_chains(chains)
    assert written["status"] == 0 and (read["status"], read["stdout"]) == (0, "x\n")
    assert broken["status"] == 1 and "ValueError: broken" in broken["stderr"]
    assert module["status"] == 0 and "usage" in module["stdout"]


IDEMPOTENT = (
    """
import importlib
import pykeen_bess
from pykeen_bess.registration import register
register(); register()
importlib.reload(pykeen_bess)
"""
    + CHECK_ALL
)

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

PIPELINE_WITHOUT_IMPORT = f"""
from pykeen.pipeline import pipeline, pipeline_from_config
config = {PIPELINE_CONFIG!r}
result = pipeline(**config)
assert type(result.training_loop).__name__ == "BessTrainingLoop"
result = pipeline_from_config(dict(metadata=dict(title="bess"), pipeline=config))
assert 0 < result.get_metric("mrr") <= 1
"""

HPO_WITHOUT_IMPORT = """
from pykeen.hpo import hpo_pipeline
result = hpo_pipeline(
    dataset="nations", model="DistMult", model_kwargs=dict(embedding_dim=8),
    training_loop="bess", training_loop_kwargs=dict(num_shards=2), evaluator="bess",
    optimizer="rowwise_adagrad",  # the plugin's optimizer has hpo_pipeline's default space (the learning rate)
    training_kwargs=dict(num_epochs=1, use_tqdm=False),
    training_kwargs_ranges=dict(batch_size=dict(type=int, low=6, high=7, scale="power_two"),
                                num_negs_per_pos=dict(type=int, low=1, high=2, scale="power_two")),
    evaluation_kwargs=dict(use_tqdm=False), n_trials=2,
)
trials = result.study.trials
assert len(trials) == 2 and all(t.state.name == "COMPLETE" for t in trials), trials
assert all("training.num_negs_per_pos" in t.params for t in trials), trials[0].params
assert all("optimizer.lr" in t.params for t in trials), trials[0].params
"""

#: programs whose first import is the plugin's, then PyKEEN's training loop makes the plugin's optimizer by name
#: (through ``class_resolver``'s torch optimizer resolver, without ``pykeen.optimizers`` imported); with the
#: plugin's names of every other resolver
PLUGIN_FIRST = (
    """
{first}
import torch
from pykeen.models import DistMult
from pykeen.triples import CoreTriplesFactory
from pykeen_bess import BessTrainingLoop
factory = CoreTriplesFactory.create(torch.tensor([[0, 0, 1], [1, 0, 2], [2, 0, 0]]), num_entities=3, num_relations=1)
model = DistMult(triples_factory=factory, embedding_dim=4, random_seed=0)
loop = BessTrainingLoop(model=model, triples_factory=factory, optimizer="rowwise_adagrad")
assert [g["rule"] for g in loop.optimizer.param_groups if "rule" in g] == ["rowwise_adagrad"], loop.optimizer
"""
    + CHECK_ALL
)
#: the plugin's imports a program may start with
PLUGIN_FIRST_IMPORTS = (
    "from pykeen_bess import BessTrainingLoop",
    "import pykeen_bess.training",
    "import pykeen_bess.evaluation",
    "import pykeen_bess.training.steps.runner",
)


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The programs below, each in a child forked from an interpreter without PyKEEN or the plugin loaded."""
    from forked_programs import run_chains

    folder = tmp_path_factory.mktemp("pykeen-cli")
    config = folder / "bess.json"
    config.write_text(json.dumps(dict(metadata=dict(title="bess"), pipeline=PIPELINE_CONFIG)))
    steps = dict(
        idempotent=dict(code=IDEMPOTENT),
        pipeline=dict(code=PIPELINE_WITHOUT_IMPORT),
        hpo=dict(code=HPO_WITHOUT_IMPORT),
        **{f"plugin first: {first}": dict(code=PLUGIN_FIRST.format(first=first)) for first in PLUGIN_FIRST_IMPORTS},
        pykeen_cli=dict(module="pykeen", argv=["experiments", "run", str(config), "-d", str(folder / "out")]),
    )
    outcomes = run_chains([[step] for step in steps.values()])
    return {name: dict(outcome, folder=folder) for name, (outcome,) in zip(steps, outcomes)}


def test_registration_is_idempotent(programs: dict[str, dict]) -> None:
    assert programs["idempotent"]["status"] == 0 and "OK" in programs["idempotent"]["stdout"], programs["idempotent"]


def test_plugin_optimizer_by_name_after_importing_the_plugin_first(programs: dict[str, dict]) -> None:
    """``BessTrainingLoop(optimizer="rowwise_adagrad")`` in a program that imports the plugin first (it was unknown)."""
    for first in PLUGIN_FIRST_IMPORTS:
        outcome = programs[f"plugin first: {first}"]
        assert outcome["status"] == 0 and "OK" in outcome["stdout"], (first, outcome["stderr"][-3000:])


def test_pipeline_and_config_without_import(programs: dict[str, dict]) -> None:
    assert programs["pipeline"]["status"] == 0, programs["pipeline"]["stderr"][-3000:]


def test_hpo_pipeline_without_import(programs: dict[str, dict]) -> None:
    assert programs["hpo"]["status"] == 0, programs["hpo"]["stderr"][-3000:]


def test_pykeen_command_line_without_import(programs: dict[str, dict]) -> None:
    outcome = programs["pykeen_cli"]
    assert outcome["status"] == 0, outcome["stderr"][-3000:]
    assert any((outcome["folder"] / "out").rglob("results.json"))
