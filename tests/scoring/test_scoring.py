"""Tests for the shared-candidate scorers in :mod:`pykeen_bess.scoring`.

Every fast scorer is compared with PyKEEN's own interaction on broadcast representations (values
and gradients, float64, both sides, several batch layouts). Concrete test classes only name the
interaction, its keyword-argument variants and the expected scorer; the generic checks live in
:class:`ScorerTestCase`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch
from pykeen.nn.modules import (
    ClampedInteraction,
    ComplExInteraction,
    CPInteraction,
    DistMAInteraction,
    DistMultInteraction,
    ERMLPInteraction,
    Interaction,
    KG2EInteraction,
    LineaREInteraction,
    PairREInteraction,
    RESCALInteraction,
    RotatEInteraction,
    SimplEInteraction,
    TransEInteraction,
    TransFInteraction,
    TransHInteraction,
    TripleREInteraction,
    UMInteraction,
)
from pykeen.nn.representation import Embedding
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pykeen_bess import scoring
from pykeen_bess.scoring import base as _scoring_base
from pykeen_bess.nn.interactions import InterHTInteraction, TranSInteraction
from pykeen_bess.scoring import (
    BroadcastScorer,
    SharedCandidateScorer,
    chunked_pairwise,
    get_scorer,
    supported_interactions,
)

#: sizes of the symbolic dimensions of PyKEEN's ``entity_shape`` / ``relation_shape``
DIMS = {"d": 5, "k": 2, "e": 3}
#: number of queries and candidates per batch element
B, K = 3, 4
#: (query batch dims, candidate batch dims): evaluation, training blocks, broadcast candidates
LAYOUTS = {
    "plain": ((), ()),
    "batched": ((2, 3), (2, 3)),
    "broadcast": ((2, 3), (2, 1)),
}
SIDES = ("head", "tail")
RTOL = ATOL = 1e-10

Representation = Any  # a tensor or a tuple of tensors, as ``ERModel._get_representations`` returns


# -- helpers -------------------------------------------------------------------------------------


def _shape(symbolic: str, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dims[c] for c in symbolic)


def _pack(parts: list[torch.Tensor]) -> Representation:
    return parts[0] if len(parts) == 1 else tuple(parts)


def _parts(x: Representation) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def random_representation(
    shapes: Sequence[str],
    batch: tuple[int, ...],
    *,
    generator: torch.Generator,
    complex_: bool = False,
    dims: Mapping[str, int] = DIMS,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Representation:
    """Random float64 (or complex128) leaf tensors of shape ``[*batch, *shape]`` for each symbolic shape."""
    dtype = torch.complex128 if complex_ else torch.float64
    parts = []
    for symbolic in shapes:
        x = torch.randn(*batch, *_shape(symbolic, dims), dtype=dtype, generator=generator)
        if transform is not None:
            x = transform(x)
        parts.append(x.requires_grad_())
    return _pack(parts)


def _unsqueeze(x: Representation, shapes: Sequence[str], offset: int) -> Representation:
    """Insert a broadcast dimension ``offset`` dims before each part's representation dims."""
    return _pack([part.unsqueeze(-len(s) - offset) for part, s in zip(_parts(x), shapes)])


def reference_scores(interaction: Interaction, side: str, e: Representation, r: Representation, c: Representation):
    """PyKEEN's interaction on broadcast ``[*B, b, 1, ...]`` x ``[*B, 1, k, ...]`` representations."""
    known_shape, candidate_shape = (
        (interaction.head_shape, interaction.tail_shape)
        if side == "tail"
        else (interaction.tail_shape, interaction.head_shape)
    )
    e = _unsqueeze(e, known_shape, 1)
    r = _unsqueeze(r, interaction.relation_shape, 1)
    c = _unsqueeze(c, candidate_shape, 2)
    return interaction(h=e, r=r, t=c) if side == "tail" else interaction(h=c, r=r, t=e)


def make_representations(
    interaction: Interaction,
    side: str,
    query_batch: tuple[int, ...],
    candidate_batch: tuple[int, ...],
    *,
    b: int = B,
    k: int = K,
    seed: int = 0,
    dims: Mapping[str, int] = DIMS,
    transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> tuple[Representation, Representation, Representation]:
    """Random known entity ``[*Bq, b, ...]``, relation ``[*Bq, b, ...]`` and candidates ``[*Bc, k, ...]``."""
    generator = torch.Generator().manual_seed(seed)
    transforms = transforms or {}
    known_shape, candidate_shape = (
        (interaction.head_shape, interaction.tail_shape)
        if side == "tail"
        else (interaction.tail_shape, interaction.head_shape)
    )
    kw = {"generator": generator, "complex_": interaction.is_complex, "dims": dims}
    e = random_representation(known_shape, (*query_batch, b), transform=transforms.get("entity"), **kw)
    r = random_representation(interaction.relation_shape, (*query_batch, b), transform=transforms.get("relation"), **kw)
    c = random_representation(candidate_shape, (*candidate_batch, k), transform=transforms.get("entity"), **kw)
    return e, r, c


def assert_gradients_close(
    fast: torch.Tensor, reference: torch.Tensor, leaves: Sequence[torch.Tensor], rtol: float = 1e-9, atol: float = 1e-10
) -> None:
    """Compare the gradients of a random weighted sum of both score tensors w.r.t. all leaves."""
    weights = torch.randn(reference.shape, dtype=reference.dtype, generator=torch.Generator().manual_seed(1))
    grads_fast = torch.autograd.grad((fast * weights).sum(), leaves, allow_unused=True)
    grads_ref = torch.autograd.grad((reference * weights).sum(), leaves, allow_unused=True)
    for i, (g_fast, g_ref) in enumerate(zip(grads_fast, grads_ref)):
        if g_ref is None:
            assert g_fast is None or torch.count_nonzero(g_fast) == 0, f"leaf {i}"
            continue
        assert g_fast is not None, f"leaf {i}: no gradient through the fast path"
        torch.testing.assert_close(g_fast, g_ref, rtol=rtol, atol=atol, msg=lambda m, i=i: f"leaf {i}: {m}")


def assert_aligned_close(scores: torch.Tensor, expected: torch.Tensor, triples: tuple) -> None:
    """Scores of aligned triples ``(h, r, t)`` and their gradients w.r.t. every representation equal PyKEEN's."""
    torch.testing.assert_close(scores, expected, rtol=RTOL, atol=ATOL)
    leaves = [x for x in tree_leaves(triples) if x.is_floating_point() or x.is_complex()]
    assert_gradients_close(scores, expected, leaves, rtol=RTOL, atol=ATOL)


class PeakStorage(TorchDispatchMode):
    """Record the largest storage (in elements) of any tensor produced by an operator."""

    def __init__(self) -> None:
        """Start with a peak of zero elements."""
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.peak = max(self.peak, t.untyped_storage().nbytes() // t.element_size())
        return out


# -- generic test case ---------------------------------------------------------------------------


class ScorerTestCase:
    """Generic checks of one fast scorer; subclasses set :attr:`cls`, :attr:`variants` and :attr:`scorer_cls`."""

    #: the PyKEEN interaction class
    cls: ClassVar[type[Interaction]]
    #: keyword-argument variants of the interaction (each one runs every test)
    variants: ClassVar[Sequence[Mapping[str, Any]]] = ({},)
    #: the expected scorer class
    scorer_cls: ClassVar[type[SharedCandidateScorer]]
    #: per-role transforms of random representations (e.g. unit-modulus relations)
    transforms: ClassVar[Mapping[str, Callable[[torch.Tensor], torch.Tensor]]] = {}

    def _setup(self, kwargs, side, layout, **kw):
        interaction = self.cls(**kwargs)
        scorer = get_scorer(interaction)
        e, r, c = make_representations(interaction, side, *LAYOUTS[layout], transforms=self.transforms, **kw)
        return interaction, scorer, e, r, c

    def test_registered(self, kwargs):
        """The interaction has its fast scorer."""
        scorer = get_scorer(self.cls(**kwargs))
        assert type(scorer) is self.scorer_cls
        # matrix products, or cdist for TransE / UM with p=1; chunked only for other norms
        p = kwargs.get("p", getattr(scorer.interaction, "p", 2))
        assert scorer.fast == (
            p == 2 or (p == 1 and isinstance(scorer, scoring.DifferenceScorer)) or self.cls is RotatEInteraction
        )
        assert self.cls.__name__ in supported_interactions()

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    @pytest.mark.parametrize("side", SIDES)
    def test_scores(self, kwargs, side, layout):
        """Fast scores equal PyKEEN's on broadcast representations, and have the documented shape."""
        interaction, scorer, e, r, c = self._setup(kwargs, side, layout)
        query, candidates = scorer.query(side, e, r), scorer.candidates(side, c)
        assert query.ndim == len(LAYOUTS[layout][0]) + 2 and candidates.ndim == len(LAYOUTS[layout][1]) + 2
        scores = scorer.score(side, query, candidates)
        expected = reference_scores(interaction, side, e, r, c)
        assert scores.shape == expected.shape == (*torch.broadcast_shapes(*LAYOUTS[layout]), B, K)
        torch.testing.assert_close(scores, expected, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(scorer.score_candidates(side, e, r, c), expected, rtol=RTOL, atol=ATOL)

    @pytest.mark.parametrize("chunked", [False, True])
    @pytest.mark.parametrize("layout", ["plain", "broadcast"])
    @pytest.mark.parametrize("side", SIDES)
    def test_gradients(self, kwargs, side, layout, chunked, monkeypatch):
        """Gradients w.r.t. the known entity, the relation and the candidates equal PyKEEN's.

        With ``chunked``, the chunked (checkpointed) computation of non-L2 norms runs in many blocks.
        """
        if chunked:
            monkeypatch.setattr(scoring.base, "MAX_CHUNK_ELEMENTS", 16)
        interaction, scorer, e, r, c = self._setup(kwargs, side, layout)
        scores = scorer.score_candidates(side, e, r, c)
        expected = self.gradient_reference(interaction, side, e, r, c)
        assert_gradients_close(scores, expected, [*_parts(e), *_parts(r), *_parts(c)])

    @pytest.mark.parametrize("side", SIDES)
    def test_gradients_of_one_row(self, kwargs, side):
        """One query against one candidate (a step with one head-corrupted slot, one negative): PyKEEN's gradients.

        A complex block's real view at an odd column of one row's features failed in the backward pass (RotatE).
        """
        interaction, scorer, e, r, c = self._setup(kwargs, side, "plain", b=1, k=1)
        scores = scorer.score_candidates(side, e, r, c)
        expected = self.gradient_reference(interaction, side, e, r, c)
        assert_gradients_close(scores, expected, [*_parts(e), *_parts(r), *_parts(c)])

    def gradient_reference(self, interaction: Interaction, side: str, e, r, c) -> torch.Tensor:
        """Return the scores whose gradients the fast path must reproduce (PyKEEN's by default)."""
        return reference_scores(interaction, side, e, r, c)

    def test_score_triples(self, kwargs):
        """``score_triples`` is PyKEEN's interaction on aligned triples and the diagonal of shared scoring."""
        interaction = self.cls(**kwargs)
        scorer = get_scorer(interaction)
        h, r, t = make_representations(interaction, "tail", (), (), b=K, transforms=self.transforms)
        scores = scorer.score_triples(h, r, t)
        expected = interaction(h=h, r=r, t=t)
        if type(scorer).score_triples is SharedCandidateScorer.score_triples:  # PyKEEN's own: bitwise
            torch.testing.assert_close(scores, expected, rtol=0, atol=0)
        else:  # a scorer's own formula: equal up to rounding, gradients too
            assert_aligned_close(scores, expected, (h, r, t))
        for side, e, c in (("tail", h, t), ("head", t, h)):
            shared = scorer.score_candidates(side, e, r, c)
            torch.testing.assert_close(torch.diagonal(shared, dim1=-2, dim2=-1), scores, rtol=RTOL, atol=ATOL)

    @pytest.mark.parametrize("side", SIDES)
    def test_aligned_scores(self, kwargs, side):
        """Inner-product scorers score aligned triples from features (PyKEEN's scores, gradients); others decline.

        A training step scores its positives with the queries of its negatives where ``aligned_scores`` does.
        """
        interaction = self.cls(**kwargs)
        scorer = get_scorer(interaction)
        h, r, t = make_representations(interaction, "tail", (), (), b=K, transforms=self.transforms)
        known, unknown = (h, t) if side == "tail" else (t, h)
        scores = scorer.aligned_scores(side, scorer.query(side, known, r), unknown)
        if not isinstance(scorer, scoring.InnerProductScorer):
            assert scores is None
            return
        expected = interaction(h=h, r=r, t=t)
        assert scores is not None and scores.shape == expected.shape
        assert_aligned_close(scores, expected, (h, r, t))

    def test_side_free_candidates(self, kwargs):
        """A scorer that declares its candidates side-free gives both sides the same candidates and scores."""
        scorer = get_scorer(self.cls(**kwargs))
        if not scorer.side_free_candidates:
            return
        _, _, e, r, c = self._setup(kwargs, "tail", "plain")
        head, tail = scorer.candidates("head", c), scorer.candidates("tail", c)
        torch.testing.assert_close(head, tail, rtol=0, atol=0)
        query = scorer.query("tail", e, r)
        torch.testing.assert_close(scorer.score("head", query, tail), scorer.score("tail", query, tail), rtol=0, atol=0)

    @pytest.mark.parametrize("side", SIDES)
    def test_no_large_intermediate(self, kwargs, side, monkeypatch):
        """No forward or backward tensor comes close to ``[b, k, d]`` (matmul or chunked scoring)."""
        b = k = 64
        dims = {"d": 8, "k": 2, "e": 3}
        monkeypatch.setattr(scoring.base, "MAX_CHUNK_ELEMENTS", b * k * dims["d"] // 16)
        _, scorer, e, r, c = self._setup(kwargs, side, "plain", b=b, k=k, dims=dims)
        with PeakStorage() as tracker:
            scores = scorer.score_candidates(side, e, r, c)
            scores.sum().backward()
        assert scores.shape == (b, k)
        assert tracker.peak < b * k * dims["d"] // 4


def pytest_generate_tests(metafunc):
    """Run every test of a :class:`ScorerTestCase` subclass for each of its interaction variants."""
    if "kwargs" in metafunc.fixturenames and metafunc.cls is not None:
        variants = metafunc.cls.variants
        metafunc.parametrize(
            "kwargs", variants, ids=[",".join(f"{k}={v}" for k, v in v.items()) or "default" for v in variants]
        )


def _unit_modulus(x: torch.Tensor) -> torch.Tensor:
    return x / x.abs()


NORM_VARIANTS = (
    {"p": 1},
    {"p": 1, "power_norm": True},
    {"p": 2},
    {"p": 2, "power_norm": True},
    {"p": 3},
    {"p": 3, "power_norm": True},
)


class TestDistMult(ScorerTestCase):
    """DistMult: one matrix product of ``e * r`` and ``c``."""

    cls = DistMultInteraction
    scorer_cls = scoring.DistMultScorer


class TestComplEx(ScorerTestCase):
    """ComplEx: real views of complex queries and candidates."""

    cls = ComplExInteraction
    scorer_cls = scoring.ComplExScorer


class TestRESCAL(ScorerTestCase):
    """RESCAL: ``h^T R`` and ``R t`` queries."""

    cls = RESCALInteraction
    scorer_cls = scoring.RESCALScorer


class TestSimplE(ScorerTestCase):
    """SimplE: both directions in one matrix product."""

    cls = SimplEInteraction
    scorer_cls = scoring.SimplEScorer


class TestCP(ScorerTestCase):
    """CP: ``[k, d]`` representations with separate head / tail roles."""

    cls = CPInteraction
    scorer_cls = scoring.CPScorer


class TestDistMA(ScorerTestCase):
    """DistMA: affine inner product."""

    cls = DistMAInteraction
    scorer_cls = scoring.DistMAScorer


class TestTransF(ScorerTestCase):
    """TransF: affine inner product."""

    cls = TransFInteraction
    scorer_cls = scoring.TransFScorer


class TestTransE(ScorerTestCase):
    """TransE: norm expansion (p=2), cdist (p=1), chunked (p=3)."""

    cls = TransEInteraction
    variants = NORM_VARIANTS
    scorer_cls = scoring.TransEScorer


class TestUM(ScorerTestCase):
    """UM: TransE without relation (an empty relation tuple)."""

    cls = UMInteraction
    variants = ({"p": 1}, {"p": 2}, {"p": 2, "power_norm": False}, {"p": 3, "power_norm": False})
    scorer_cls = scoring.UMScorer


class TestRotatE(ScorerTestCase):
    """RotatE, compared with PyKEEN on unit-modulus relations.

    PyKEEN computes ``|h - conj(r) t|`` instead of ``|h r - t|`` when that is cheaper (here: for heads);
    both agree for ``|r| = 1``, but their gradients w.r.t. ``r`` differ in the radial direction, so
    gradients are compared with the literal formula (as in :func:`test_rotate_general_modulus`).
    """

    cls = RotatEInteraction
    scorer_cls = scoring.RotatEScorer
    transforms: ClassVar[Mapping[str, Callable[[torch.Tensor], torch.Tensor]]] = {"relation": _unit_modulus}

    def gradient_reference(self, interaction, side, e, r, c):
        return (
            _literal_rotate(e.unsqueeze(-2), r.unsqueeze(-2), c.unsqueeze(-3))
            if side == "tail"
            else _literal_rotate(c.unsqueeze(-3), r.unsqueeze(-2), e.unsqueeze(-2))
        )


class TestPairRE(ScorerTestCase):
    """PairRE: weighted difference ``h r_h - t r_t``."""

    cls = PairREInteraction
    variants = ({"p": 1}, {"p": 2}, {"p": 2, "power_norm": True}, {"p": 3})
    scorer_cls = scoring.PairREScorer


class TestTripleRE(ScorerTestCase):
    """TripleRE: weighted difference with offset ``u``."""

    cls = TripleREInteraction
    variants = ({}, {"u": None, "p": 2}, {"u": 0.5, "p": 2, "power_norm": True}, {"u": 2.0, "p": 3})
    scorer_cls = scoring.TripleREScorer


class TestLineaRE(ScorerTestCase):
    """LineaRE: weighted difference with bias ``r_m``."""

    cls = LineaREInteraction
    variants = ({"p": 1}, {"p": 2}, {"p": 2, "power_norm": True})
    scorer_cls = scoring.LineaREScorer


class TestInterHT(ScorerTestCase):
    """InterHT: two candidate factors."""

    cls = InterHTInteraction
    variants = (*NORM_VARIANTS, {"u": None}, {"u": 0.5, "p": 1})
    scorer_cls = scoring.InterHTScorer


class TestTranS(ScorerTestCase):
    """TranS: two candidate factors."""

    cls = TranSInteraction
    variants = (*NORM_VARIANTS, {"u": None}, {"u": 0.5, "p": 1})
    scorer_cls = scoring.TranSScorer


class TestClamped(ScorerTestCase):
    """PyKEEN's clamping wrapper (SimplE's model uses it): the base's fast scorer, then the clamp."""

    cls = ClampedInteraction
    variants = (
        {"base": SimplEInteraction, "clamp_score": 0.5},
        {"base": DistMultInteraction, "clamp_score": None},
        {"base": TransEInteraction, "base_kwargs": {"p": 2}, "clamp_score": (-3.0, -1.0)},
    )
    scorer_cls = scoring.ClampedScorer

    def test_registered(self, kwargs):
        scorer = get_scorer(self.cls(**kwargs))
        assert type(scorer) is self.scorer_cls and scorer.fast
        assert type(scorer.base) is type(get_scorer(scorer.interaction.base))


def test_simple_model_is_fast_scored():
    """SimplE's model wraps its interaction in ClampedInteraction: it still gets the fast scorer."""
    from pykeen.datasets import Nations
    from pykeen.models import SimplE

    model = SimplE(triples_factory=Nations().training, embedding_dim=4, random_seed=0)
    scorer = get_scorer(
        model.interaction,
        entity_representations=model.entity_representations,
        relation_representations=model.relation_representations,
    )
    assert isinstance(scorer, scoring.ClampedScorer) and isinstance(scorer.base, scoring.SimplEScorer) and scorer.fast


# -- RotatE with general relations -----------------------------------------------------------------


def _literal_rotate(h: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return -(h * r - t).abs().pow(2).sum(dim=-1).sqrt()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("side", SIDES)
def test_rotate_general_modulus(side, layout):
    """RotatE's fast scores are exact for relations of any modulus (values and gradients)."""
    scorer = get_scorer(RotatEInteraction())
    e, r, c = make_representations(RotatEInteraction(), side, *LAYOUTS[layout])
    assert not torch.allclose(r.abs(), torch.ones_like(r.abs()))
    scores = scorer.score_candidates(side, e, r, c)
    r_, e_, c_ = r.unsqueeze(-2), e.unsqueeze(-2), c.unsqueeze(-3)
    expected = _literal_rotate(e_, r_, c_) if side == "tail" else _literal_rotate(c_, r_, e_)
    torch.testing.assert_close(scores, expected, rtol=RTOL, atol=ATOL)
    assert_gradients_close(scores, expected, [e, r, c])


# -- L2 details ------------------------------------------------------------------------------------


@pytest.mark.parametrize("power_norm", [False, True])
def test_l2_zero_distance_gradient_is_finite(power_norm):
    """A candidate equal to the query has score 0 (up to sqrt(eps^2)) and finite gradients."""
    scorer = get_scorer(TransEInteraction(p=2, power_norm=power_norm))
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    r = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    scores = scorer.score_candidates("tail", h, r, h.detach().clone())
    assert torch.diagonal(scores).abs().max() < 1e-7
    (grad,) = torch.autograd.grad(scores.sum(), h)
    assert torch.isfinite(grad).all()


def test_chunked_pairwise_blocks(monkeypatch):
    """The chunked helper splits queries and candidates, and handles empty inputs."""
    monkeypatch.setattr(scoring.base, "MAX_CHUNK_ELEMENTS", 8)
    calls = []

    def pair_scores(q, c):
        calls.append((q.shape[-3], c.shape[-2]))
        return -(q - c).abs().sum(dim=-1)

    query = torch.randn(2, 5, 3, dtype=torch.float64)
    candidates = torch.randn(1, 7, 3, dtype=torch.float64)
    scores = chunked_pairwise(query, candidates, pair_scores)
    torch.testing.assert_close(scores, pair_scores(query.unsqueeze(-2), candidates.unsqueeze(-3)))
    assert len(calls) > 1 and all(2 * b * k * 3 <= 8 or (b, k) == (1, 1) for b, k in calls[:-1])
    assert chunked_pairwise(query, candidates[:, :0], pair_scores).shape == (2, 5, 0)
    assert chunked_pairwise(query[:, :0], candidates, pair_scores).shape == (2, 0, 7)


@pytest.mark.parametrize(
    "interaction",
    [TransEInteraction(p=2), InterHTInteraction(p=2)],
    ids=["TransE", "InterHT"],
)
def test_large_shared_candidates(interaction):
    """Scoring b = k = 2048 against d = 512 runs quickly without a [b, k, d] float32 intermediate (8 GiB)."""
    b = k = 2048
    dims = {"d": 512}
    generator = torch.Generator().manual_seed(0)
    e = tuple(torch.randn(b, dims["d"], generator=generator) for _ in interaction.entity_shape)
    c = tuple(torch.randn(k, dims["d"], generator=generator) for _ in interaction.entity_shape)
    r = torch.randn(b, dims["d"], generator=generator)
    e, c = _pack(list(e)), _pack(list(c))
    scorer = get_scorer(interaction)
    start = time.perf_counter()
    with torch.no_grad(), PeakStorage() as tracker:
        scores = scorer.score_candidates("tail", e, r, c)
    elapsed = time.perf_counter() - start
    assert scores.shape == (b, k) and torch.isfinite(scores).all()
    assert tracker.peak <= 8 * b * k  # features [b, 5d + 1] and the [b, k] scores, no [b, k, d]
    assert elapsed < 30
    # spot check against PyKEEN on a few rows
    rows = slice(0, 3)
    expected = interaction(
        h=_unsqueeze(_pack([x[rows] for x in _parts(e)]), interaction.head_shape, 1),
        r=r[rows].unsqueeze(-2),
        t=_unsqueeze(c, interaction.tail_shape, 2),
    )
    torch.testing.assert_close(scores[rows], expected, rtol=1e-3, atol=1e-3)


# -- fallback ----------------------------------------------------------------------------------------


def _embeddings(shapes: Sequence[str], complex_: bool = False) -> list[Embedding]:
    dtype = torch.cfloat if complex_ else None
    return [Embedding(max_id=2, shape=_shape(s, DIMS), dtype=dtype) for s in shapes]


def test_get_scorer_fallback(caplog):
    """Interactions without a fast scorer get the broadcast fallback (with a warning) if it is possible."""
    interaction = ERMLPInteraction(embedding_dim=DIMS["d"], hidden_dim=3)
    entities, relations = _embeddings(interaction.entity_shape), _embeddings(interaction.relation_shape)
    with pytest.raises(NotImplementedError, match="no fast shared-candidate scorer"):
        get_scorer(interaction)
    with pytest.raises(NotImplementedError):
        get_scorer(interaction, entity_representations=entities, relation_representations=relations, allow_slow=False)
    scoring._WARNED_FALLBACKS.discard("ERMLPInteraction")
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        scorer = get_scorer(interaction, entity_representations=entities, relation_representations=relations)
        # a second scorer (the evaluator after the training loop) does not warn again
        get_scorer(interaction, entity_representations=entities, relation_representations=relations)
    assert isinstance(scorer, BroadcastScorer) and not scorer.fast
    assert caplog.text.count("ERMLPInteraction") == 1
    assert "ERMLPInteraction" not in supported_interactions()


def _positive(x: torch.Tensor) -> torch.Tensor:
    return x.abs() + 0.5


#: interaction, transforms of the random representations, whether to compare relation gradients
#: (PyKEEN's RotatE picks ``|h - conj(r) t|`` or ``|h r - t|`` by the broadcast shapes, which chunking
#: changes: the values agree for ``|r| = 1``, the radial gradients w.r.t. ``r`` do not)
BROADCAST_CASES = {
    "TransH": (TransHInteraction(p=2), {}, True),
    "KG2E": (KG2EInteraction(), {"entity": _positive, "relation": _positive}, True),
    "RotatE-complex": (RotatEInteraction(), {"relation": _unit_modulus}, False),
    "UM-no-relation": (UMInteraction(p=1), {}, True),
    "ERMLP": (ERMLPInteraction(embedding_dim=DIMS["d"], hidden_dim=3).double(), {}, True),
}


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("layout", ["plain", "broadcast"])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", list(BROADCAST_CASES))
def test_broadcast_scorer(case, side, layout, chunked, monkeypatch):
    """The broadcast fallback equals PyKEEN for multi-representation, complex and relation-less interactions."""
    if chunked:
        monkeypatch.setattr(scoring.base, "MAX_CHUNK_ELEMENTS", 16)
    interaction, transforms, relation_gradients = BROADCAST_CASES[case]
    scorer = BroadcastScorer(
        interaction,
        entity_specs=[
            scoring.representation_spec(x) for x in _embeddings(interaction.entity_shape, interaction.is_complex)
        ],
        relation_specs=[
            scoring.representation_spec(x) for x in _embeddings(interaction.relation_shape, interaction.is_complex)
        ],
    )
    e, r, c = make_representations(interaction, side, *LAYOUTS[layout], transforms=transforms)
    expected = reference_scores(interaction, side, e, r, c)
    scores = scorer.score_candidates(side, e, r, c)
    torch.testing.assert_close(scores, expected, rtol=RTOL, atol=ATOL)
    assert_gradients_close(scores, expected, [*_parts(e), *(_parts(r) if relation_gradients else []), *_parts(c)])


def test_supported_interactions():
    """All fast scorers are reported, sorted."""
    names = supported_interactions()
    assert names == sorted(names)
    expected = {
        "TransEInteraction",
        "UMInteraction",
        "DistMultInteraction",
        "ComplExInteraction",
        "RESCALInteraction",
        "RotatEInteraction",
        "PairREInteraction",
        "TripleREInteraction",
        "LineaREInteraction",
        "InterHTInteraction",
        "TranSInteraction",
    }
    assert expected <= set(names)


@pytest.mark.parametrize("k", [63, 64, 65, 130, 3627])
def test_matmul_scores_pad_odd_rows_without_gradients(k: int) -> None:
    """Without gradients, scores of an odd number of candidates are rows of a padded buffer, equal to the product."""
    generator = torch.Generator().manual_seed(k)
    query, candidates = torch.randn(7, 16, generator=generator), torch.randn(k, 16, generator=generator)
    expected = query @ candidates.t()
    with torch.no_grad():
        scores = _scoring_base.matmul_scores(query, candidates)
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6)
    alignment = _scoring_base.SCORE_ROW_ALIGNMENT
    assert scores.stride() == ((-(-k // alignment) * alignment if k > alignment else k), 1)
    query.requires_grad_(True)
    scores = _scoring_base.matmul_scores(query, candidates)  # with gradients: the plain product
    assert scores.is_contiguous() and scores.requires_grad
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [5, 64, 100])
def test_matmul_scores_into_a_buffer(k: int) -> None:
    """With ``out`` the scores are a view of the buffer (its row stride), equal to the product; else it is ignored."""
    generator = torch.Generator().manual_seed(k)
    query, candidates = torch.randn(7, 16, generator=generator), torch.randn(k, 16, generator=generator)
    expected = query @ candidates.t()
    buffer = torch.full((9, 128), float("nan"))
    with torch.no_grad():
        scores = _scoring_base.matmul_scores(query, candidates, out=buffer)
    assert scores.data_ptr() == buffer.data_ptr() and scores.stride() == (128, 1)
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6)
    assert torch.isnan(buffer[7:]).all() and torch.isnan(buffer[:, k:]).all()
    # too small, another dtype, or gradients needed: a new tensor
    for out in (torch.empty(6, 128), torch.empty(9, k - 1), torch.empty(9, 128, dtype=torch.float64)):
        with torch.no_grad():
            other = _scoring_base.matmul_scores(query, candidates, out=out)
        assert other.data_ptr() != out.data_ptr()
        torch.testing.assert_close(other, expected, rtol=1e-6, atol=1e-6)
    query.requires_grad_(True)
    scores = _scoring_base.matmul_scores(query, candidates, out=buffer)
    assert scores.requires_grad and scores.data_ptr() != buffer.data_ptr()


def test_score_into_writes_products_and_scores_others() -> None:
    """Inner-product scorers write into the buffer; the others (an L1 distance) return their scores."""
    from pykeen.nn.modules import DistMultInteraction, TransEInteraction

    from pykeen_bess.scoring import get_scorer

    generator = torch.Generator().manual_seed(0)
    query, candidates = torch.randn(4, 8, generator=generator), torch.randn(6, 8, generator=generator)
    buffer = torch.empty(4, 64)
    for interaction in (DistMultInteraction(), TransEInteraction(p=1)):
        scorer = get_scorer(interaction)
        with torch.no_grad():
            expected = scorer.score("tail", query, candidates)
            scores = scorer.score_into("tail", query, candidates, buffer)
        torch.testing.assert_close(scores, expected)
        assert (scores.data_ptr() == buffer.data_ptr()) == isinstance(interaction, DistMultInteraction)


def test_l1_distances_as_a_broadcast_reduction_equal_cdist_forward_and_backward() -> None:
    """The form the GPU path compiles (a fused reduction) is ``torch.cdist(p=1)``, gradients included."""
    from pykeen_bess.scoring.distances import _pairwise_l1, l1_distances

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 3, 5, 7, dtype=torch.float64, generator=generator, requires_grad=True)
    candidates = torch.randn(2, 3, 4, 7, dtype=torch.float64, generator=generator, requires_grad=True)
    expected = torch.cdist(query, candidates, p=1)
    actual = _pairwise_l1(query, candidates)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(l1_distances(query, candidates), expected)
    weights = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    for got, want in zip(
        torch.autograd.grad(actual, (query, candidates), weights),
        torch.autograd.grad(expected, (query, candidates), weights),
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_l1_distances_of_half_precision_rows_on_the_cpu(dtype: torch.dtype) -> None:
    """The CPU's cdist has no half kernel ("cdist" not implemented for 'Half': TransE with p=1 failed to train)."""
    from pykeen_bess.scoring.distances import l1_distances

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 5, 7, generator=generator).to(dtype).requires_grad_()
    candidates = torch.randn(3, 4, 7, generator=generator).to(dtype)
    distances = l1_distances(query, candidates)
    assert distances.dtype == dtype
    torch.testing.assert_close(distances, torch.cdist(query.float(), candidates.float(), p=1).to(dtype))
    distances.sum().backward()
    assert query.grad is not None and query.grad.dtype == dtype


def test_matmul_scores_promote_mixed_dtypes() -> None:
    """A model moved to float64 keeps a host table's float32 rows: the product promotes, as PyKEEN's scoring does
    (BessEvaluator failed with "expected scalar type Double but found Float")."""
    from pykeen_bess.scoring.base import matmul_scores

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 6, dtype=torch.float64, generator=generator)
    candidates = torch.randn(70, 6, generator=generator)
    scores = matmul_scores(query, candidates)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, query @ candidates.double().t(), rtol=0, atol=0)
    buffer = torch.empty(8, 80, dtype=torch.float64)
    torch.testing.assert_close(matmul_scores(query, candidates, out=buffer), scores, rtol=0, atol=0)
