"""PyTorch-BigGraph checkpoints of PyKEEN models, checked with real torchbiggraph 1.0.0 (in this process)."""

from __future__ import annotations

import json
import pathlib

import h5py
import pytest
import torch
from typed_graphs import typed_graph
from pbg_tools import import_one_relation, pbg_config, pbg_model, pbg_scores
from pykeen.datasets import Nations
from pykeen.models import ComplEx, DistMult, PairRE, RESCAL, RotatE, TransE
from pykeen.nn.representation import Embedding

from pykeen_bess import pbg
from pykeen_bess.pbg import TypedGraph

MODELS = {
    "DistMult": (DistMult, dict(embedding_dim=6)),
    "TransE": (TransE, dict(embedding_dim=6, scoring_fct_norm=2)),
    "TransE-squared": (TransE, dict(embedding_dim=6, scoring_fct_norm=2, power_norm=True)),
    "ComplEx": (ComplEx, dict(embedding_dim=3)),
    "RotatE": (RotatE, dict(embedding_dim=3)),
    "RESCAL": (RESCAL, dict(embedding_dim=4)),
}


def graph_of(kind: str) -> TypedGraph:
    """A typed graph (typed relations, 2 partitions) or Nations (dynamic relations), with or without inverses."""
    if kind == "typed":
        return typed_graph(num_partitions=2)
    dataset = Nations(create_inverse_triples=kind == "dynamic-inverse")
    return TypedGraph.from_factories(dataset.training, dataset.validation, dataset.testing, num_partitions=2)


def pykeen_scores(model, triples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyKEEN's head-prediction and tail-prediction scores of each triple (they differ with inverse triples)."""
    with torch.no_grad():
        rows = torch.arange(triples.shape[0])
        head = model.predict_h(triples[:, 1:])[rows, triples[:, 0]]
        tail = model.predict_t(triples[:, :2])[rows, triples[:, 2]]
    return head, tail


def some_triples(graph: TypedGraph, count: int = 24) -> torch.Tensor:
    """Test triples plus corrupted ones of the right types (scores of non-edges too)."""
    triples = graph.testing.mapped_triples[:count].clone()
    shuffled = triples[torch.randperm(triples.shape[0], generator=torch.Generator().manual_seed(0))]
    schema = graph.schema
    same_type = schema.entity_type[shuffled[:, 2]] == schema.entity_type[triples[:, 2]]
    corrupted = triples.clone()
    corrupted[same_type, 2] = shuffled[same_type, 2]
    return torch.cat([triples, corrupted])


@pytest.mark.parametrize("kind", ["typed", "dynamic", "dynamic-inverse"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_pytorch_biggraph_scores_equal_pykeen(tmp_path: pathlib.Path, name: str, kind: str) -> None:
    graph = graph_of(kind)
    cls, kwargs = MODELS[name]
    model = cls(triples_factory=graph.training, random_seed=3, **kwargs)
    if kind == "typed" and graph.training.create_inverse_triples:
        pytest.skip("typed graphs here have no inverse triples")
    pbg.write_checkpoint(model, graph, tmp_path, version=4)
    # PyTorch-BigGraph loads the model with strict=True: every parameter key matches
    pbg_model(tmp_path)
    config = pbg_config(tmp_path)
    assert not config.global_emb and not config.bias and config.dynamic_relations == graph.schema.dynamic_relations
    triples = some_triples(graph)
    head, tail = pbg_scores(tmp_path, graph.schema, triples)
    expected_head, expected_tail = pykeen_scores(model, triples)
    torch.testing.assert_close(head, expected_head, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, expected_tail, rtol=1e-5, atol=1e-5)
    # and back: the same scores from the model read from the checkpoint
    again = pbg.read_checkpoint(tmp_path, graph)
    assert type(again) is cls
    head_again, tail_again = pykeen_scores(again, triples)
    torch.testing.assert_close(head_again, expected_head, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tail_again, expected_tail, rtol=1e-6, atol=1e-6)
    assert (tmp_path / "checkpoint_version.txt").read_text() == "4\n"


def test_files_of_a_checkpoint(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(num_partitions=3)
    model = DistMult(triples_factory=graph.training, embedding_dim=4, random_seed=0)
    pbg.write_checkpoint(model, graph, tmp_path, version=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        ["checkpoint_version.txt", "config.json", "config.py", "entities", "model.v2.h5"]
        + [f"embeddings_{t}_{p}.v2.h5" for t in ("user", "item", "tag") for p in range(3)]
    )
    with h5py.File(tmp_path / "embeddings_item_1.v2.h5") as file:
        assert file.attrs["format_version"] == 1
        rows = torch.from_numpy(file["embeddings"][...])
    ids = graph.schema.partition_range(1, 1)
    torch.testing.assert_close(rows, model.entity_representations[0](torch.arange(ids.start, ids.stop)).detach())
    with h5py.File(tmp_path / "model.v2.h5") as file:
        assert file["model/relations/2/operator/rhs/diagonal"].attrs["state_dict_key"] == "rhs_operators.2.diagonal"
    entities = tmp_path / "entities"
    assert json.loads((entities / "dynamic_rel_names.json").read_text()) == list(graph.schema.relation_names)
    assert (entities / "entity_count_tag_2.txt").read_text() == "2\n"
    # a newer version replaces the old one's files only after the pointer moved
    pbg.write_checkpoint(model, graph, tmp_path, version=3)
    assert not list(tmp_path.glob("*.v2.h5")) and (tmp_path / "model.v3.h5").is_file()
    with pytest.raises(ValueError, match="newer than version 1"):
        pbg.write_checkpoint(model, graph, tmp_path, version=1)


def test_a_checkpoint_config_names_absolute_paths(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written to a relative directory, and given a config with its own paths: PBG's tools run from anywhere."""
    graph = typed_graph(num_partitions=2)
    model = DistMult(triples_factory=graph.training, embedding_dim=4, random_seed=0)
    monkeypatch.chdir(tmp_path)
    written = pbg.write_checkpoint(model, graph, "ckpt", version=1, config=dict(entity_path="x", checkpoint_path="y"))
    assert written == tmp_path / "ckpt"
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["checkpoint_path"] == str(tmp_path / "ckpt")
    assert config["entity_path"] == str(tmp_path / "ckpt" / "entities")
    assert {name: entity["num_partitions"] for name, entity in config["entities"].items()} == {
        name: 2 for name in graph.schema.entity_types
    }


@pytest.mark.parametrize(
    ("model_factory", "message"),
    [
        (lambda f: TransE(triples_factory=f, embedding_dim=4), "p=1"),
        (lambda f: PairRE(triples_factory=f, embedding_dim=4), "cannot express PairRE"),
    ],
)
def test_models_pytorch_biggraph_cannot_express(tmp_path: pathlib.Path, model_factory, message) -> None:
    graph = typed_graph()
    with pytest.raises(ValueError, match=message):
        pbg.write_checkpoint(model_factory(graph.training), graph, tmp_path)
    assert not tmp_path.joinpath("checkpoint_version.txt").exists()


def test_rotate_needs_unit_moduli(tmp_path: pathlib.Path) -> None:
    graph = typed_graph()
    model = RotatE(triples_factory=graph.training, embedding_dim=3)
    with torch.no_grad():
        model.relation_representations[0]._embeddings.weight.mul_(2.0)
    with pytest.raises(ValueError, match="modulus 1"):
        pbg.write_checkpoint(model, graph, tmp_path)


def test_inverse_triples_need_dynamic_relations(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(create_inverse_triples=True)
    model = DistMult(triples_factory=graph.training, embedding_dim=4)
    with pytest.raises(ValueError, match="only with dynamic relations"):
        pbg.write_checkpoint(model, graph, tmp_path)


def edit_model_file(path: pathlib.Path, edit) -> None:
    """Change a model file as PyTorch-BigGraph would have written it (its datasets carry no digests)."""
    with h5py.File(path, "a") as file:
        edit(file)

        def drop_digest(name: str, item) -> None:
            if isinstance(item, h5py.Dataset):
                item.attrs.pop("pykeen_bess_crc32", None)

        file.visititems(drop_digest)


def test_global_embeddings_and_max_norm_are_folded_in(tmp_path: pathlib.Path) -> None:
    """A PyTorch-BigGraph checkpoint with global embeddings and max_norm reads as PyTorch-BigGraph scores it."""
    graph = typed_graph(num_partitions=2)
    model = TransE(triples_factory=graph.training, embedding_dim=6, scoring_fct_norm=2, random_seed=1)
    with torch.no_grad():
        model.entity_representations[0]._embeddings.weight.mul_(3.0)  # some rows beyond max_norm
    pbg.write_checkpoint(model, graph, tmp_path, version=1)
    generator = torch.Generator().manual_seed(1)

    def add_global(file) -> None:
        for name in graph.schema.entity_types:
            dataset = file.create_dataset(
                f"model/entities/{name}/global_embedding", data=torch.randn(6, generator=generator).numpy()
            )
            dataset.attrs["state_dict_key"] = f"global_embs.emb_{name}"

    edit_model_file(tmp_path / "model.v1.h5", add_global)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(global_emb=True, max_norm=1.5)
    (tmp_path / "config.json").write_text(json.dumps(config))
    triples = some_triples(graph)
    expected_head, expected_tail = pbg_scores(tmp_path, graph.schema, triples)
    head, tail = pykeen_scores(pbg.read_checkpoint(tmp_path, graph), triples)
    torch.testing.assert_close(head, expected_head, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, expected_tail, rtol=1e-5, atol=1e-5)


def test_dynamic_operators_trained_apart_need_inverse_relations(tmp_path: pathlib.Path) -> None:
    """PyTorch-BigGraph trains the head- and tail-prediction operators of dynamic relations separately."""
    graph = graph_of("dynamic")
    model = ComplEx(triples_factory=graph.training, embedding_dim=3, random_seed=2)
    pbg.write_checkpoint(model, graph, tmp_path, version=1)

    def perturb(file) -> None:
        data = file["model/relations/0/operator/lhs/real"]
        data[...] = data[...] + 0.5

    edit_model_file(tmp_path / "model.v1.h5", perturb)
    with pytest.raises(ValueError, match="create_inverse_triples=True"):
        pbg.read_checkpoint(tmp_path, graph)
    dataset = Nations(create_inverse_triples=True)
    inverse = TypedGraph.from_factories(dataset.training, dataset.validation, dataset.testing, num_partitions=2)
    triples = some_triples(inverse)
    expected_head, expected_tail = pbg_scores(tmp_path, inverse.schema, triples)
    head, tail = pykeen_scores(pbg.read_checkpoint(tmp_path, inverse), triples)
    torch.testing.assert_close(head, expected_head, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, expected_tail, rtol=1e-5, atol=1e-5)


def test_missing_files_are_errors_not_silent_defaults(tmp_path: pathlib.Path) -> None:
    """PyTorch-BigGraph silently re-initialises a missing partition or operator; reading refuses."""
    graph = typed_graph(num_partitions=2)
    model = DistMult(triples_factory=graph.training, embedding_dim=4)
    pbg.write_checkpoint(model, graph, tmp_path, version=1)
    edit_model_file(tmp_path / "model.v1.h5", lambda file: file.__delitem__("model/relations/1/operator/rhs/diagonal"))
    with pytest.raises(ValueError, match="lacks the operator of relation 'likes'"):
        pbg.read_checkpoint(tmp_path, graph)
    (tmp_path / "embeddings_tag_1.v1.h5").unlink()
    with pytest.raises(FileNotFoundError, match="embeddings_tag_1.v1.h5 is missing"):
        pbg.read_checkpoint(tmp_path, graph)


def test_a_checkpoint_of_another_graph_is_refused(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(num_partitions=2)
    pbg.write_checkpoint(DistMult(triples_factory=graph.training, embedding_dim=4), graph, tmp_path)
    other = typed_graph(num_partitions=3)
    with pytest.raises(FileNotFoundError, match="embeddings_user_2"):
        pbg.read_checkpoint(tmp_path, other)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dimension"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"shape \(15, 4\), expected \(15, 5\)"):
        pbg.read_checkpoint(tmp_path, graph)


def test_the_pre_release_checkpoint_layout(tmp_path: pathlib.Path) -> None:
    """Seed 003's checkpoints: {type}_{part}.pt tuples (1-based parts), METADATA_1.pt, CHECKPOINT_VERSION."""
    graph = typed_graph(num_partitions=2)
    model = TransE(triples_factory=graph.training, embedding_dim=4, scoring_fct_norm=2, random_seed=5)
    schema = graph.schema
    rows = model.entity_representations[0](None).detach()
    relation = model.relation_representations[0](None).detach()
    for t, name in enumerate(schema.entity_types):
        for p in range(2):
            ids = schema.partition_range(t, p)
            torch.save((torch.nn.Parameter(rows[ids.start : ids.stop]), None), tmp_path / f"{name}_{p + 1}.pt.7")
    state = {f"rhs_operators.{r}.translation": -relation[r] for r in range(schema.num_relations)}
    config = pbg.graph_config(graph, dict(dimension=4, operator="translation", comparator="l2"), checkpoint_path="x")
    torch.save((config, 7, 0, state, None), tmp_path / "METADATA_1.pt.7")
    (tmp_path / "CHECKPOINT_VERSION").write_text("7")
    triples = some_triples(graph)
    head, tail = pykeen_scores(pbg.read_checkpoint(tmp_path, graph), triples)
    expected_head, expected_tail = pykeen_scores(model, triples)
    torch.testing.assert_close(head, expected_head)
    torch.testing.assert_close(tail, expected_tail)


def test_a_model_to_fill(tmp_path: pathlib.Path) -> None:
    graph = typed_graph()
    model = ComplEx(triples_factory=graph.training, embedding_dim=3, random_seed=0)
    pbg.write_checkpoint(model, graph, tmp_path)
    target = ComplEx(triples_factory=graph.training, embedding_dim=3, random_seed=9)
    assert pbg.read_checkpoint(tmp_path, graph, model=target) is target
    torch.testing.assert_close(
        target.entity_representations[0]._embeddings.weight, model.entity_representations[0]._embeddings.weight
    )
    assert isinstance(target.entity_representations[0], Embedding)
    with pytest.raises(ValueError, match="not the given DistMult"):
        pbg.read_checkpoint(tmp_path, graph, model=DistMult(triples_factory=graph.training, embedding_dim=6))


def _empty_partition_graph(tmp_path):
    """Six users buy three items, each type in 4 partitions: item partition 3 is empty."""
    lines = "".join(f"u{i}\tbuys\ti{i % 3}\n" for i in range(6))
    graph, _ = import_one_relation(tmp_path / "buys.tsv", lines, "user", "buys", "item", num_partitions=4)
    assert graph.schema.partition_sizes[1][3] == 0
    return graph


def test_an_empty_partition_is_written_with_the_row_width(tmp_path) -> None:
    """PyTorch-BigGraph writes an empty partition as ``[0, D]``; so does write_checkpoint, and it reads back."""
    from pykeen_bess import pbg

    graph = _empty_partition_graph(tmp_path)
    model = DistMult(triples_factory=graph.training, embedding_dim=8, random_seed=0)
    pbg.write_checkpoint(model, graph, tmp_path / "checkpoint")
    with h5py.File(tmp_path / "checkpoint" / "embeddings_item_3.v0.h5") as file:
        assert file["embeddings"].shape == (0, 8)
    restored = pbg.read_checkpoint(tmp_path / "checkpoint", graph)
    batch = graph.training.mapped_triples
    torch.testing.assert_close(restored.score_hrt(batch), model.score_hrt(batch))


def test_a_training_with_an_empty_partition_writes_pbg_checkpoints(tmp_path) -> None:
    """checkpoint_format="pbg" with an empty partition (its checkpoint failed after the epoch's training)."""
    from pykeen.pipeline import pipeline

    graph = _empty_partition_graph(tmp_path)
    pipeline(
        training=graph.training,
        testing=graph.training,
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=4, checkpoint_format="pbg"),
        training_kwargs=dict(
            num_epochs=1, batch_size=2, checkpoint_directory=str(tmp_path / "run"), checkpoint_name="b.pt"
        ),
        random_seed=0,
        evaluation_kwargs=dict(use_tqdm=False),
    )
    (written,) = (tmp_path / "run").glob("embeddings_item_3.v*.h5")
    with h5py.File(written) as file:
        assert file["embeddings"].shape == (0, 8)


def test_rescal_from_a_pbg_checkpoint_is_unregularized() -> None:
    """PyTorch-BigGraph regularizes nothing: the RESCAL it builds has no L2 term (RESCAL's default is one)."""
    from pykeen.models import model_resolver

    from pykeen_bess.pbg.conversion import conversion_for_model_name

    dataset = Nations()
    for name in ("DistMult", "ComplEx", "RESCAL", "TransE"):
        model = model_resolver.make(
            name, triples_factory=dataset.training, **conversion_for_model_name(name).model_kwargs(8)
        )
        model.train()
        model.score_hrt(dataset.training.mapped_triples[:10])
        assert float(model.collect_regularization_term()) == 0.0, name
