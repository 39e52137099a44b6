"""The evaluation's steady state runs on the device: no host synchronisation per block or batch, few operators.

On a GPU, every read of a device value on the host (``.item()``, ``bool(tensor)``, ``.tolist()``,
``.cpu()``) waits for all queued kernels, and operators whose output size depends on the data
(``nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave``
without a size) read a size on the host; each host-side operator costs launch time. These tests
record, on the CPU, every aten operator that one block, one batch and one evaluation dispatch
(:class:`OpRecorder`, a ``TorchDispatchMode``) and every call of the Python methods that copy
device data to the host, and count those that would synchronise on a GPU.

Before this design (one ``rank_batch`` per batch and target, measured with the same recorder on
Nations, DistMult, 100 queries, one shard), a batch issued 232 operators with 1 block, 283 with
2 and 528 with 7 (about 49 per block and 183 per batch), of which 27 synchronised: 13 ``.cpu()``
copies, 4 ``.numpy()``, 1 ``.tolist()``, 2 ``nonzero``, 1 ``repeat_interleave``, 1 ``unique``, 3
``bool(tensor)`` and 2 ``.item()``; a whole evaluation of Nations' 201 test triples synchronised
92 times with 1 batch and 686 times with 10 batches. Now a block issues 48 operators (54 with
reading its candidate rows), a batch about 45 more, none of them synchronising, and an
evaluation synchronises the same number of times (35 here, most of them PyKEEN's input checks and
the filter index's checks) for 1 and for 10 batches.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult, TransE
from torch.utils._python_dispatch import TorchDispatchMode

from pykeen_bess.evaluation import BessEvaluator, FilterIndex, ShardedScoring
from pykeen_bess.evaluation.counting import TIE_TOLERANCE, band_scale
from pykeen_bess.evaluation.ranking import ExcludedPairs, count_scored_block, rank_batch
from pykeen_bess.evaluation.sharded import feature_norms

#: aten operators that read data-dependent values or sizes on the host (they synchronise with a GPU)
SYNCHRONISING = (
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::masked_select",
    "aten::equal",
    "aten::repeat_interleave",
)
#: Python methods that copy a tensor's data to the host (on a GPU: a device-to-host copy that waits)
HOST_COPIES = ("tolist", "numpy", "cpu")

#: operators of one steady-state block (:func:`count_scored_block`, DistMult, a block of one CPU
#: chunk; measured: 48): the band (the slice's largest feature norm: ``linalg_vector_norm``,
#: ``amax``; ``tau = base + slope * norm``: ``addcmul``; ``t - tau``, ``t + tau``: 5), the scores
#: (``transpose``, ``matmul``: 2; into the evaluator's buffer ``t``, two slices of it and ``mm``:
#: 4), counting (two ``unsqueeze``; three ``empty`` buffers; per CPU chunk its row ``slice``, two
#: comparisons and three sums into buffer slices and selects; the float counts to ``long`` and
#: ``add_``: 24), the excluded pairs (``==``, ``>=``, ``<``, ``&``
#: twice, ``-``, ``clamp``, the gather and the gathers of both bounds, ``>``, ``<``, ``&`` twice,
#: ``stack``, ``to``, ``zeros``, ``index_add_`` along the rows of a ``[B, 2]`` buffer, ``t``, ``sub_``:
#: 20... minus shared views) and the row-sum check (``isfinite``, ``~``). The old design issued
#: about 49 per block, but with host reads per batch.
BLOCK_BUDGET = 52
#: operators per block within a batch (measured: 55 for DistMult on one shard): the block, reading
#: the slice's candidate rows (the embedding lookup of ``ForwardRows``) and accumulating the flags
BLOCK_IN_BATCH_BUDGET = 60
#: operators of a batch besides its blocks with one shard (measured: 44-46; the old design: about
#: 183): the queries (the known entities' rows, the relation rows, their product), the true scores
#: (the true entities' rows and a batched ``[B, 1, q] x [B, q, 1]`` product), the band's per-query
#: parts, the count buffer and the non-finite flags
BATCH_BUDGET = 50
#: operators per further shard of a batch (measured: 30): each shard reads the rows of the known
#: and the true entities it owns (a lookup and a ``where`` per entity representation)
SHARD_BUDGET = 35


class OpRecorder(TorchDispatchMode):
    """Record every aten operator and every host copy (``tolist``, ``numpy``, ``cpu``) in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self._originals: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_COPIES:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                self.ops[f"host copy: Tensor.{_name}"] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        """The number of aten operators."""
        return sum(count for name, count in self.ops.items() if not name.startswith("host copy"))

    @property
    def synchronising(self) -> dict[str, int]:
        """The synchronising operators and host copies, by name."""
        return {
            name: count
            for name, count in self.ops.items()
            if name.startswith(SYNCHRONISING) or name.startswith("host copy")
        }


@functools.cache
def nations() -> Nations:
    return Nations()


def setting(model_cls=DistMult, num_shards: int = 1):
    """A float32 model on Nations, its scoring, filter index and the excluded pairs of the test tail queries."""
    data = nations()
    model = model_cls(triples_factory=data.training, random_seed=0).eval()
    scoring = ShardedScoring.for_model(model, num_shards=num_shards)
    triples = data.testing.mapped_triples
    known = [data.training.mapped_triples, data.validation.mapped_triples, triples]
    index = FilterIndex.from_triples(known, data.num_entities, data.num_relations)
    heads, relations, tails = triples.unbind(dim=1)
    pairs = ExcludedPairs.build(scoring, index, "tail", heads, relations, tails, batch_size=100)
    return model, scoring, triples, pairs


@pytest.mark.parametrize("buffered", [False, True])
def test_a_block_does_not_synchronise(buffered: bool):
    """Scoring, counting and correcting one block: no host read, at most BLOCK_BUDGET operators.

    Buffered as the evaluator scores it (into its :class:`~pykeen_bess.evaluation.ranking.BlockBuffer`),
    and into a new tensor.
    """
    from pykeen_bess.evaluation.ranking import BlockBuffer

    model, scoring, triples, pairs = setting()
    heads, relations, tails = triples[:100].unbind(dim=1)
    with torch.inference_mode():
        queries = scoring.queries("tail", heads, relations)
        true_scores = scoring.true_scores(queries, tails)
        band = band_scale(true_scores, feature_norms(queries.features), TIE_TOLERANCE)
        counts = torch.zeros((2, 100), dtype=torch.long)
        start, _, candidates = next(scoring.candidate_blocks("tail", 0, 7))
        out = BlockBuffer(100, 7).of(true_scores) if buffered else None
        with OpRecorder() as recorder:
            count_scored_block(
                scoring,
                queries,
                true_scores,
                band,
                candidates,
                0,
                start,
                (pairs.rows[0], pairs.positions[0], pairs.columns[0]),
                counts,
                out=out,
            )
    assert recorder.synchronising == {}, recorder.ops
    assert recorder.total <= BLOCK_BUDGET, recorder.ops
    if out is not None:  # the block was written into the buffer
        with torch.inference_mode():
            expected = scoring.scores(queries, candidates)
        assert torch.equal(out[:100, : expected.shape[1]], expected)


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("model_cls", [DistMult, TransE])
def test_a_batch_does_not_synchronise(model_cls, num_shards: int):
    """A whole batch (queries, true scores, every block of every shard): no host read; operators grow per block only."""
    model, scoring, triples, pairs = setting(model_cls, num_shards)
    heads, relations, tails = triples[:100].unbind(dim=1)
    totals = {}
    for slice_size in (14, 2):
        with torch.inference_mode(), OpRecorder() as recorder:
            rank_batch(
                scoring,
                "tail",
                heads,
                relations,
                tails,
                (pairs.rows[0], pairs.positions[0], pairs.columns[0]),
                slice_size,
                TIE_TOLERANCE,
            )
        assert recorder.synchronising == {}, recorder.ops
        blocks = sum(-(-count // slice_size) for count in scoring.candidate_counts)
        totals[blocks] = recorder.total
        budget = BATCH_BUDGET + SHARD_BUDGET * (num_shards - 1) + BLOCK_IN_BATCH_BUDGET * blocks
        assert recorder.total <= budget, recorder.ops
    few, many = sorted(totals)
    per_block = (totals[many] - totals[few]) / (many - few)
    assert per_block <= BLOCK_IN_BATCH_BUDGET, totals


def test_an_evaluation_reads_the_host_independently_of_the_number_of_batches():
    """Host reads happen once per evaluation (the filter lookup, the layout, the flagged queries, the results).

    With the band off (no near-ties to rank again) the count of synchronising calls is the same for 1
    and for 10 batches; the copies of the results to the host are one per evaluation.
    """
    data = nations()
    model = DistMult(triples_factory=data.training, random_seed=0).eval()
    triples = data.testing.mapped_triples
    kwargs = {"additional_filter_triples": [data.training.mapped_triples], "use_tqdm": False}
    synchronising = {}
    metrics = {}
    for batch_size in (len(triples), -(-len(triples) // 10)):
        evaluator = BessEvaluator(num_shards=2, batch_size=batch_size, slice_size=3, tie_tolerance=0)
        evaluator.evaluate(model, triples, **kwargs)  # the first evaluation builds the device tables
        with OpRecorder() as recorder:
            result = evaluator.evaluate(model, triples, **kwargs)
        metrics[batch_size] = result.to_flat_dict()
        synchronising[batch_size] = recorder.synchronising
    (one, sync_one), (ten, sync_ten) = synchronising.items()
    assert metrics[one] == metrics[ten]
    assert sync_one == sync_ten, synchronising
