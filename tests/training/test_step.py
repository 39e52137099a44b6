"""One training step: what it reads on the host, and how replicated gradients are reduced."""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads
from pykeen.datasets import Nations
from pykeen.models import DistMult
from pykeen.training import TrainingCallback
from pykeen.triples import CoreTriplesFactory

from pykeen_bess.distributed import LocalTopology
from pykeen_bess.training import BessTrainingLoop


@pytest.fixture(scope="module")
def factory() -> CoreTriplesFactory:
    dataset = Nations()
    return CoreTriplesFactory.create(
        mapped_triples=dataset.training.mapped_triples[:300],
        num_entities=dataset.num_entities,
        num_relations=dataset.num_relations,
    )


class CountSteps(TrainingCallback):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
        self.steps += 1


@pytest.mark.parametrize("static_step", [False, True])
@pytest.mark.parametrize("clipping", [dict(gradient_clipping_max_norm=0.5), dict(gradient_clipping_max_abs_value=0.1)])
def test_a_step_reads_only_its_loss_on_the_host(
    factory: CoreTriplesFactory, clipping: dict, static_step: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager step reads one value computed from the model per step (the loss); clipping reads none.

    The static step (with a GPU's updates: the CPU's read the step's flag and distinct rows, which costs
    nothing there) reads it only for a callback that asks for every step's loss (this one does), its flag
    once at the first step (below), and
    once per epoch the loss sum and the step counts (one copy, ``tolist``, not a scalar read, so not
    counted here). On a GPU every such read waits for the device; the rows, masks and weights of a step
    are computed from the sampling plan on the CPU (the eager step) or from device buffers (the static
    step) instead.
    """
    from pykeen_bess.training.steps.static_update import StaticUpdate

    monkeypatch.setattr(StaticUpdate, "host_rules", False)
    model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
    loop = BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=2,
        num_negs_per_pos=4,
        optimizer="adam",
        automatic_memory_optimization=False,
        static_step=static_step,
    )
    counter = CountSteps()
    with HostReads([*loop.tables.weights(), *loop.tables.replicated_parameters()]) as reads:
        loop.train(
            factory, num_epochs=2, batch_size=16, sub_batch_size=8, use_tqdm=False, callbacks=counter, **clipping
        )
    assert counter.steps > 10 and (loop.static is not None) == static_step
    # the static step's first step also reads its flag once: torch's optimizer creates the replicated
    # parameters' state inside its step, and a first step with a non-finite loss must create none
    first = [read for read in reads.reads if "dense_update.py" in read]
    assert len(first) == (1 if static_step else 0), first
    assert len(reads.reads) - len(first) == counter.steps, "\n".join(sorted(set(reads.reads)))


class CountingTopology(LocalTopology):
    """Logical shards that pretend to be processes, counting the reductions of replicated gradients."""

    def __init__(self, n_shard: int) -> None:
        super().__init__(n_shard)
        self.coalesced_calls = 0

    @property
    def is_distributed(self) -> bool:
        return True

    def all_reduce_coalesced(self, tensors):
        self.coalesced_calls += 1
        return super().all_reduce_coalesced(tensors)


def test_replicated_gradients_are_reduced_in_one_call_and_none_stays_none(factory: CoreTriplesFactory) -> None:
    model = DistMult(triples_factory=factory, embedding_dim=8, random_seed=0)
    model.unused = torch.nn.Parameter(torch.ones(3))  # a replicated parameter without a gradient
    loop = BessTrainingLoop(model=model, triples_factory=factory, num_shards=2, automatic_memory_optimization=False)
    topology = CountingTopology(2)
    runner = loop.make_runner(block_size=4, topology=topology)
    runner.topology = topology
    batch = next(iter(loop.make_sampler(loop.partition(factory), 4).epoch(1)))
    with loop.tables.installed(copy_weights=True):
        runner.forward_backward(batch, sub_block_size=4, label_smoothing=0.0)
        runner.hand_off_gradients()
    replicated = loop.tables.replicated_parameters()
    assert len(replicated) >= 2 and topology.coalesced_calls == 1
    assert model.unused.grad is None  # no process had a gradient: the optimizer skips it, as in one process
    assert model.relation_representations[0]._embeddings.weight.grad is not None
