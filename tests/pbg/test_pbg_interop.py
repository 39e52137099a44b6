"""Round trips through PyTorch-BigGraph's own command-line tools (torchbiggraph 1.0.0, in subprocesses).

* PyTorch-BigGraph trains on the input files written here and continues a BESS run's checkpoint;
* BESS continues a checkpoint PyTorch-BigGraph trained;
* ``torchbiggraph_export_to_tsv`` on a BESS checkpoint prints the model's values;
* the output of PyTorch-BigGraph's TSV importer, read here, equals PyKEEN's factory by labels.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
from pbg_tools import run
from pykeen.datasets import Nations
from pykeen.models import DistMult
from pykeen.pipeline import pipeline
from typed_graphs import TYPES, labeled, typed_graph

from pykeen_bess import pbg
from pykeen_bess.pbg import files
from pykeen_bess.pbg.checkpoint import relation_parameters
from pykeen_bess.pbg.conversion import conversion_for_model

pytestmark = pytest.mark.slow

#: what a PyTorch-BigGraph training needs beyond the written config: one worker, no delays, a real loss
PBG_TRAINING = ["workers=1", "hogwild_delay=0", "loss_fn=softmax", "batch_size=40", "num_batch_negs=10"]


def bess_run(graph, directory: pathlib.Path, num_epochs: int):
    """A BESS pipeline run with typed negatives and checkpoints in PyTorch-BigGraph's layout (2 shards)."""
    return pipeline(
        training=graph.training,
        testing=graph.testing,
        model=DistMult,
        model_kwargs=dict(embedding_dim=6, regularizer=None),
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=2, negatives="typed", checkpoint_format="pbg"),
        negative_sampler_kwargs=dict(num_negs_per_pos=4),
        optimizer="adam",
        optimizer_kwargs=dict(lr=0.05),
        training_kwargs=dict(
            num_epochs=num_epochs,
            batch_size=32,
            checkpoint_directory=str(directory),
            checkpoint_name="bess.pt",
            checkpoint_frequency=0,
            use_tqdm=False,
        ),
        evaluation_kwargs=dict(use_tqdm=False),
        random_seed=2,
    )


def partition_rows(directory: pathlib.Path, version: int, schema) -> torch.Tensor:
    """All rows of a checkpoint version, in global id order."""
    return torch.cat(
        [
            files.read_embeddings(files.embeddings_file(directory, name, p, version))[0]
            for t, name in enumerate(schema.entity_types)
            for p in range(len(schema.partition_sizes[t]))
        ]
    )


def test_pytorch_biggraph_and_bess_continue_each_others_checkpoints(tmp_path: pathlib.Path) -> None:
    graph = pbg.write(typed_graph(num_partitions=2), tmp_path / "data")  # PyTorch-BigGraph's input files
    checkpoint = tmp_path / "checkpoint"
    bess_run(graph, checkpoint, num_epochs=2)
    ours = partition_rows(checkpoint, 2, graph.schema)

    # 1. PyTorch-BigGraph resumes BESS's checkpoint exactly: epoch 3 with a zero learning rate keeps our values
    exact = tmp_path / "exact"
    shutil.copytree(checkpoint, exact)
    run(
        "torchbiggraph_train",
        "config.py",
        "-p",
        f"checkpoint_path={exact}",
        "num_epochs=3",
        "lr=0",
        *PBG_TRAINING,
        cwd=exact,
    )
    assert files.read_version(exact) == 3
    assert not list(exact.glob("*.v2.h5"))  # PyTorch-BigGraph removed our version after its commit
    torch.testing.assert_close(partition_rows(exact, 3, graph.schema), ours, rtol=0, atol=0)
    stats = [json.loads(line) for line in (exact / "training_stats.json").read_text().splitlines()]
    assert {line["epoch_idx"] for line in stats} == {2}  # it trained epoch 3 only, on our edge files

    # 2. and trains epoch 3 for real from our values (PyTorch-BigGraph's own initialisation is 1e-3 x N(0, 1))
    run("torchbiggraph_train", "config.py", "-p", "num_epochs=3", "lr=0.05", *PBG_TRAINING, cwd=checkpoint)
    theirs = partition_rows(checkpoint, 3, graph.schema)
    change = (theirs - ours).norm(dim=1) / ours.norm(dim=1)
    assert 0 < float(change.max()) < 0.5

    # 3. BESS continues PyTorch-BigGraph's checkpoint: with 3 epochs done nothing is trained and the model holds
    # PyTorch-BigGraph's values; a fourth epoch trains on from them and is written as version 4
    result = bess_run(graph, checkpoint, num_epochs=3)
    assert result.losses == []
    torch.testing.assert_close(result.model.entity_representations[0](None).detach(), theirs)
    result = bess_run(graph, checkpoint, num_epochs=4)
    assert len(result.losses) == 1 and files.read_version(checkpoint) == 4
    run("torchbiggraph_train", "config.py", "-p", "num_epochs=5", *PBG_TRAINING, cwd=checkpoint)  # and back again
    assert files.read_version(checkpoint) == 5


def test_export_to_tsv_prints_the_models_values(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(num_partitions=2, repeated_names=True)
    model = DistMult(triples_factory=graph.training, embedding_dim=5, random_seed=4)
    pbg.write_checkpoint(model, graph, tmp_path / "checkpoint", version=1)
    run(
        "torchbiggraph_export_to_tsv",
        "config.py",
        "--entities-output",
        str(tmp_path / "entities.tsv"),
        "--relation-types-output",
        str(tmp_path / "relations.tsv"),
        cwd=tmp_path / "checkpoint",
    )
    rows = model.entity_representations[0](None).detach()
    lines = (tmp_path / "entities.tsv").read_text().splitlines()
    assert len(lines) == graph.schema.num_entities
    # entities in type order, partition by partition: the global id order
    labels = graph.entity_labels()
    for index, line in enumerate(lines):
        name, *values = line.split("\t")
        assert name == graph.schema.name_of(int(graph.schema.entity_type[index]), labels[index])
        torch.testing.assert_close(torch.tensor([float(v) for v in values]), rows[index], rtol=0, atol=1e-8)
    parameters = relation_parameters(model, graph.schema, conversion_for_model(model))
    relations = (tmp_path / "relations.tsv").read_text().splitlines()
    assert len(relations) == graph.schema.num_relations
    for index, line in enumerate(relations):
        name, side, operator, param, shape, *values = line.split("\t")
        assert (name, side, operator, param) == (graph.schema.relation_names[index], "rhs", "diagonal", "diagonal")
        expected = parameters[f"relations/{index}/operator/rhs/diagonal"]
        torch.testing.assert_close(torch.tensor([float(v) for v in values]), expected, rtol=0, atol=1e-8)


def write_tsv(path: pathlib.Path, rows: np.ndarray) -> pathlib.Path:
    np.savetxt(path, rows, fmt="%s", delimiter="\t")
    return path


def test_pytorch_biggraphs_importer_output_equals_pykeens_factory(tmp_path: pathlib.Path) -> None:
    dataset = Nations()
    train = write_tsv(tmp_path / "train.tsv", dataset.training.label_triples(dataset.training.mapped_triples))
    test = write_tsv(tmp_path / "test.tsv", dataset.testing.label_triples(dataset.testing.mapped_triples))
    config = dict(
        entities={"all": {"num_partitions": 1}},
        relations=[{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": "diagonal"}],
        dynamic_relations=True,
        entity_path=str(tmp_path / "data"),
        edge_paths=[str(tmp_path / "data" / "train"), str(tmp_path / "data" / "test")],
        checkpoint_path=str(tmp_path / "model"),
        dimension=8,
    )
    (tmp_path / "config.py").write_text(f"def get_torchbiggraph_config():\n    return {config!r}\n")
    run(
        "torchbiggraph_import_from_tsv",
        "-l",
        "0",
        "-r",
        "2",
        "--rel-col",
        "1",
        "config.py",
        str(train),
        str(test),
        cwd=tmp_path,
    )
    graph = pbg.read(tmp_path / "data", config=tmp_path / "config.py", splits=("training", "testing"))
    # the importer shuffles names and relations without a seed: compare by labels
    assert labeled(graph.training) == labeled(dataset.training)
    assert labeled(graph.testing) == labeled(dataset.testing)
    assert set(graph.training.relation_to_id) == set(dataset.training.relation_to_id)


def test_pytorch_biggraphs_typed_partitioned_import(tmp_path: pathlib.Path) -> None:
    """Typed relations and two partitions of users: the importer leaves empty buckets without files."""
    source = typed_graph(repeated_names=False)
    labels = source.training.label_triples(source.training.mapped_triples)
    train = write_tsv(tmp_path / "train.tsv", labels)
    types = source.schema.entity_types
    config = dict(
        entities={name: {"num_partitions": 2 if name == "user" else 1} for name, _ in TYPES},
        relations=[
            {"name": n, "lhs": types[lhs], "rhs": types[rhs], "operator": "diagonal"}
            for n, lhs, rhs in zip(source.schema.relation_names, source.schema.relation_lhs, source.schema.relation_rhs)
        ],
        entity_path=str(tmp_path / "data"),
        edge_paths=[str(tmp_path / "data" / "train")],
        checkpoint_path=str(tmp_path / "model"),
        dimension=8,
    )
    (tmp_path / "config.py").write_text(f"def get_torchbiggraph_config():\n    return {config!r}\n")
    run("torchbiggraph_import_from_tsv", "-l", "0", "-r", "2", "--rel-col", "1", "config.py", str(train), cwd=tmp_path)
    graph = pbg.read(tmp_path / "data", config=tmp_path / "config.py")
    assert graph.schema.partition_sizes[0] == (15, 15)
    assert labeled(graph.training) == labeled(source.training)


def test_the_command_line_resumes_dynamic_relations_pytorch_biggraph_trained(tmp_path: pathlib.Path, capsys) -> None:
    """The how-to's command-line round trip on an untyped graph (dynamic relations): BESS, PyTorch-BigGraph, BESS.

    PyTorch-BigGraph trains a dynamic relation's head- and tail-prediction operators apart: BESS resumes its
    version as a model with inverse relations (``--inverse-triples``); without it the error says so.
    """
    from pykeen_bess.cli import main

    generator = np.random.default_rng(1)
    for name, count in (("train", 400), ("test", 40)):
        rows = generator.integers(0, [30, 4, 30], size=(count, 3))
        (tmp_path / f"{name}.tsv").write_text("".join(f"e{h}\tr{r}\te{t}\n" for h, r, t in rows))
    data, checkpoints = tmp_path / "data", tmp_path / "run"
    files_ = [str(tmp_path / f"{name}.tsv") for name in ("train", "train", "test")]
    assert main(["pbg", "import", *files_, "--output", str(data), "--partitions", "2", "--dim", "8"]) == 0
    train = ["train", "--pbg", str(data), "--num-shards", "2", "--checkpoint-format", "pbg", "--quiet"]
    train += ["--checkpoint-directory", str(checkpoints), "--checkpoint-name", "bess.pt", "--eval-batch-size", "64"]
    assert main([*train, "--epochs", "1"]) == 0
    run("torchbiggraph_train", "config.py", "-p", "num_epochs=2", *PBG_TRAINING, cwd=checkpoints)
    assert files.read_version(checkpoints) == 2
    capsys.readouterr()
    assert main([*train, "--epochs", "3"]) == 2
    assert "--inverse-triples" in capsys.readouterr().err
    assert main([*train, "--epochs", "3", "--inverse-triples"]) == 0
    assert files.read_version(checkpoints) == 3
    assert main(["train", "--dataset", "nations", "--inverse-triples", "--epochs", "1", "--quiet"]) == 2
    assert "--inverse-triples needs --pbg" in capsys.readouterr().err
