"""Tests for the InterHT and TranS interactions and models."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pytest
import torch
from docdata import get_docdata
from pykeen.datasets import Nations
from pykeen.losses import NSSALoss
from pykeen.models import ERModel
from pykeen.nn.modules import NormBasedInteraction
from pykeen.pipeline import pipeline

from pykeen_bess.nn.interactions import InterHTInteraction, TranSInteraction
from pykeen_bess.nn.models import InterHT, TranS
from pykeen_bess.scoring import get_scorer

D = 6


def _literal_norm(x: torch.Tensor, p: int, power_norm: bool) -> torch.Tensor:
    powered = (x.abs() ** p).sum(dim=-1)
    return -powered if power_norm else -(powered ** (1.0 / p))


def _literal_interht(h, r, t, u: float):
    (h, h_aux), (t, t_aux) = h, t
    return h * (t_aux + u) - t * (h_aux + u) + r


def _literal_trans(h, r, t, u: float):
    (h, h_tilde), (t, t_tilde), (r, r_bar, r_hat) = h, t, r
    return h * (t_tilde + u + r_bar) - t * (h_tilde + u - r_hat) + r


class InteractionTestCase:
    """Generic checks of a BESS interaction against a literal re-implementation of its formula."""

    cls: ClassVar[type[NormBasedInteraction]]
    #: the literal ``x`` whose negative norm is the score
    literal: ClassVar[Callable[..., torch.Tensor]]
    num_relation_vectors: ClassVar[int]
    name: ClassVar[str]
    arxiv: ClassVar[str]

    def test_shapes_and_defaults(self):
        """Shapes, defaults and docdata."""
        interaction = self.cls()
        assert isinstance(interaction, NormBasedInteraction)
        assert tuple(interaction.entity_shape) == ("d", "d")
        assert tuple(interaction.relation_shape) == ("d",) * self.num_relation_vectors
        assert (interaction.u, interaction.p, interaction.power_norm) == (1.0, 2, False)
        docdata = get_docdata(self.cls)
        assert docdata["name"] == self.name
        assert str(docdata["citation"]["arxiv"]) == self.arxiv
        assert "---" not in self.cls.__doc__

    @pytest.mark.parametrize("power_norm", [False, True])
    @pytest.mark.parametrize("p", [1, 2, 3])
    @pytest.mark.parametrize("u", [1.0, 0.5, None])
    def test_literal(self, u, p, power_norm):
        """Scores equal the formula on broadcast representations ``[3, 1, d]`` x ``[1, 4, d]``."""
        generator = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, D, dtype=torch.float64, generator=generator)

        h = (rand(3, 1), rand(3, 1))
        t = (rand(1, 4), rand(1, 4))
        r = (
            rand(3, 1)
            if self.num_relation_vectors == 1
            else tuple(rand(3, 1) for _ in range(self.num_relation_vectors))
        )
        scores = self.cls(u=u, p=p, power_norm=power_norm)(h=h, r=r, t=t)
        expected = _literal_norm(type(self).literal(h, r, t, u or 0.0), p=p, power_norm=power_norm)
        assert scores.shape == (3, 4)
        torch.testing.assert_close(scores, expected, rtol=1e-12, atol=1e-12)


class TestInterHTInteraction(InteractionTestCase):
    """InterHT: one relation vector."""

    cls = InterHTInteraction
    literal = _literal_interht
    num_relation_vectors = 1
    name = "InterHT"
    arxiv = "2202.04897"


class TestTranSInteraction(InteractionTestCase):
    """TranS: three relation vectors."""

    cls = TranSInteraction
    literal = _literal_trans
    num_relation_vectors = 3
    name = "TranS"
    arxiv = "2204.08401"


# -- models ------------------------------------------------------------------------------------------

MODELS = [InterHT, TranS]


@pytest.fixture(scope="module")
def nations() -> Nations:
    """Return the (bundled, small) Nations dataset."""
    return Nations()


def _entity_norms(model: ERModel) -> list[torch.Tensor]:
    return [rep(indices=None).norm(dim=-1) for rep in model.entity_representations]


@pytest.mark.parametrize("model_cls", MODELS)
def test_model_defaults(model_cls, nations):
    """Two unit-length entity vectors, the right relation vectors and interaction, NSSA loss."""
    model = model_cls(triples_factory=nations.training, embedding_dim=8, random_seed=0)
    assert isinstance(model.interaction, model_cls.interaction_cls)
    assert len(model.entity_representations) == 2
    assert len(model.relation_representations) == model_cls.num_relation_vectors
    assert isinstance(model.loss, NSSALoss)
    for norms in _entity_norms(model):
        torch.testing.assert_close(norms, torch.ones_like(norms))
    assert get_docdata(model_cls)["citation"]["year"] == 2022


@pytest.mark.parametrize(
    "kwargs",
    [
        {"entity_normalizer": None},
        {"entity_representations_kwargs": {"normalizer": None}},
        {"entity_representations_kwargs": [{"normalizer": None}, {"normalizer": None}]},
    ],
)
def test_model_overrides(kwargs, nations):
    """The entity normalizer can be disabled, also through representation kwargs overrides."""
    model = InterHT(triples_factory=nations.training, embedding_dim=8, random_seed=0, u=0.5, p=1, **kwargs)
    assert (model.interaction.u, model.interaction.p) == (0.5, 1)
    for norms in _entity_norms(model):
        assert not torch.allclose(norms, torch.ones_like(norms))


@pytest.mark.parametrize("initializer", [torch.nn.init.uniform_, "uniform", "uniform_"])
@pytest.mark.parametrize("model_cls", MODELS)
def test_a_uniform_initializer_by_name_keeps_the_default_range(model_cls, initializer, nations):
    """``uniform`` draws from ``[-1/d, 1/d]`` given as the function or by name (as a configuration file gives it)."""
    model = model_cls(
        triples_factory=nations.training, embedding_dim=8, random_seed=0, relation_initializer=initializer
    )
    weight = model.relation_representations[0]._embeddings.weight
    assert float(weight.abs().max()) <= 1 / 8 and float(weight.abs().max()) > 1 / 16


def test_model_overrides_wrong_length(nations):
    """Per-representation overrides must match the number of representations."""
    with pytest.raises(ValueError, match="Expected 3"):
        TranS(triples_factory=nations.training, relation_representations_kwargs=[{}, {}])


@pytest.mark.parametrize("model_cls", MODELS)
def test_fast_scorer_matches_model(model_cls, nations):
    """The fast scorer on the model's representations equals the model's own 1-to-all scores."""
    model = model_cls(triples_factory=nations.training, embedding_dim=8, random_seed=0).double()
    scorer = get_scorer(model.interaction)
    batch = nations.training.mapped_triples[:5]
    with torch.no_grad():
        h, r, _ = model._get_representations(h=batch[:, 0], r=batch[:, 1], t=None, mode=None)
        _, _, all_entities = model._get_representations(h=None, r=None, t=None, mode=None)
        tail_scores = scorer.score_candidates("tail", h, r, all_entities)
        torch.testing.assert_close(tail_scores, model.score_t(batch[:, :2]), rtol=1e-10, atol=1e-10)
        _, r, t = model._get_representations(h=None, r=batch[:, 1], t=batch[:, 2], mode=None)
        head_scores = scorer.score_candidates("head", t, r, all_entities)
        torch.testing.assert_close(head_scores, model.score_h(batch[:, 1:]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("model_cls", MODELS)
def test_pipeline_and_save(model_cls, tmp_path):
    """One epoch on Nations through the pipeline; the pickled model scores identically."""
    result = pipeline(
        dataset="nations",
        model=model_cls,
        model_kwargs={"embedding_dim": 16},
        training_kwargs={"num_epochs": 1, "batch_size": 256},
        random_seed=0,
        device="cpu",
    )
    losses: list[Any] = result.losses
    assert len(losses) == 1 and losses[0] == losses[0]  # not NaN
    result.save_to_directory(tmp_path)
    loaded = torch.load(tmp_path / "trained_model.pkl", weights_only=False)
    assert type(loaded) is model_cls
    triples = result.training.mapped_triples[:32]
    result.model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.score_hrt(triples), result.model.score_hrt(triples), rtol=0, atol=0)
        torch.testing.assert_close(loaded.score_t(triples[:, :2]), result.model.score_t(triples[:, :2]), rtol=0, atol=0)


def test_interaction_argument_in_pipeline():
    """The interaction also works as ``ERModel(interaction=...)`` through the pipeline."""
    kwargs: Mapping[str, Any] = {
        "interaction": TranSInteraction,
        "interaction_kwargs": {"p": 1},
        "entity_representations_kwargs": [{"shape": 8}, {"shape": 8}],
        "relation_representations_kwargs": [{"shape": 8}] * 3,
    }
    result = pipeline(
        dataset="nations",
        model=ERModel,
        model_kwargs=kwargs,
        training_kwargs={"num_epochs": 1, "batch_size": 256},
        random_seed=0,
        device="cpu",
    )
    assert isinstance(result.model.interaction, TranSInteraction)
