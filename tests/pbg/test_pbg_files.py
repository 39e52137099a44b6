"""PyTorch-BigGraph input files: round trips, bad input, the pre-release layout and TSV import."""

from __future__ import annotations

import json
import pathlib
import shutil

import h5py
import numpy as np
import pytest
import torch
from typed_graphs import labeled, typed_graph
from pykeen.datasets import Kinships, Nations
from pykeen.triples import TriplesFactory

from pykeen_bess import pbg
from pykeen_bess.pbg import TypedGraph
from pykeen_bess.pbg.config import load_config

DATASETS = {"nations": Nations, "kinships": Kinships}


def dataset_graph(name: str, num_partitions: int) -> TypedGraph:
    dataset = DATASETS[name]()
    return TypedGraph.from_factories(
        dataset.training, dataset.validation, dataset.testing, num_partitions=num_partitions, seed=1
    )


def assert_same_graph(a: TypedGraph, b: TypedGraph) -> None:
    assert a.schema.entity_types == b.schema.entity_types
    assert a.schema.partition_sizes == b.schema.partition_sizes
    assert a.schema.relation_names == b.schema.relation_names
    assert a.schema.relation_lhs == b.schema.relation_lhs and a.schema.relation_rhs == b.schema.relation_rhs
    assert a.entity_labels() == b.entity_labels()  # same ids: the layout is the files'
    assert set(a.splits) == set(b.splits)
    for name in a.splits:
        assert labeled(a.splits[name]) == labeled(b.splits[name])
        assert sorted(map(tuple, a.splits[name].mapped_triples.tolist())) == sorted(
            map(tuple, b.splits[name].mapped_triples.tolist())
        )


@pytest.mark.parametrize("num_partitions", [1, 2, 3])
@pytest.mark.parametrize("source", ["nations", "kinships", "typed"])
def test_write_then_read_gives_the_same_graph(tmp_path: pathlib.Path, source: str, num_partitions: int) -> None:
    graph = typed_graph(num_partitions) if source == "typed" else dataset_graph(source, num_partitions)
    written = pbg.write(graph, tmp_path, config=dict(dimension=8, operator="diagonal", comparator="dot"))
    # every bucket is written, empty ones too (PyTorch-BigGraph's trainer needs all of them)
    for split in graph.splits:
        assert len(list((tmp_path / split).glob("edges_*_*.h5"))) == num_partitions**2
    again = pbg.read(tmp_path)  # the config written next to the files
    assert_same_graph(graph, again)
    assert again.edge_paths == written.edge_paths
    config = load_config(tmp_path / "config.json")
    assert config["edge_paths"] == [str(tmp_path / split) for split in graph.splits] and not config["global_emb"]
    assert config["eval_fraction"] == 0.0


def test_a_written_config_names_the_graphs_partitions_and_paths(tmp_path: pathlib.Path) -> None:
    """A full PyTorch-BigGraph config (other partitions, relative paths) cannot hide part of the written graph."""
    graph = typed_graph(2)
    types = graph.schema.entity_types
    config = {
        "entities": {name: {"num_partitions": 1} for name in types},
        "relations": [
            {"name": name, "lhs": types[lhs], "rhs": types[rhs], "operator": "translation" if i == 0 else "diagonal"}
            for i, (name, lhs, rhs) in enumerate(
                zip(graph.schema.relation_names, graph.schema.relation_lhs, graph.schema.relation_rhs)
            )
        ],
        "dimension": 8,
        "entity_path": "elsewhere",
        "edge_paths": ["elsewhere/training"],
        "checkpoint_path": "model",
    }
    written = pbg.write(graph, tmp_path / "data", config=config)
    again = pbg.read(tmp_path / "data")
    assert_same_graph(graph, again)  # every partition and bucket: the config names the files' partitions
    settings = load_config(tmp_path / "data" / "config.json")
    assert {name: entity["num_partitions"] for name, entity in settings["entities"].items()} == dict.fromkeys(types, 2)
    assert [relation["operator"] for relation in settings["relations"]][:2] == ["translation", "diagonal"]
    assert settings["entity_path"] == str(tmp_path / "data")
    assert settings["edge_paths"] == [str(path) for path in written.edge_paths.values()]


def test_read_with_a_python_config_and_moved_files(tmp_path: pathlib.Path) -> None:
    """A PyTorch-BigGraph .py config with relative paths; the data directory moved elsewhere."""
    graph = typed_graph(2)
    pbg.write(graph, tmp_path / "data")
    config = {
        "entities": {name: {"num_partitions": 2} for name in graph.schema.entity_types},
        "relations": [
            {
                "name": n,
                "lhs": graph.schema.entity_types[lhs],
                "rhs": graph.schema.entity_types[rhs],
                "operator": "diagonal",
            }
            for n, lhs, rhs in zip(graph.schema.relation_names, graph.schema.relation_lhs, graph.schema.relation_rhs)
        ],
        "entityPath": "data",  # mixed case, as older configs
        "edge_paths": ["data/training", "data/testing"],
        "checkpoint_path": "model",
        "dimension": 8,
        "comparator": "dot",
    }
    (tmp_path / "config.py").write_text(f"def get_torchbiggraph_config():\n    return {config!r}\n")
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "data", moved)
    again = pbg.read(moved, config=tmp_path / "config.py", splits=("training", "testing"))
    assert labeled(again.training) == labeled(graph.training)
    assert labeled(again.testing) == labeled(graph.testing)
    assert again.validation is None
    assert again.edge_paths["training"] == moved / "training"


def test_a_copied_or_moved_input_directory_reads_its_own_edges(tmp_path: pathlib.Path) -> None:
    """A written directory's config names absolute paths: a copy read the original's edges (silently another
    graph once the original was written again), and a moved one could not be read."""
    graph = dataset_graph("nations", 2)
    config = dict(dimension=8, operator="diagonal", comparator="dot")
    pbg.write(graph, tmp_path / "original", config=config)
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    smaller = TypedGraph.from_factories(*(DATASETS["kinships"]().training,), num_partitions=2, seed=1)
    pbg.write(smaller, tmp_path / "original", config=config)  # the original holds another graph now
    copy = pbg.read(tmp_path / "copy")
    assert_same_graph(graph, copy)
    assert copy.edge_paths["training"] == tmp_path / "copy" / "training"
    shutil.move(tmp_path / "copy", tmp_path / "moved")
    assert_same_graph(graph, pbg.read(tmp_path / "moved"))


def test_names_repeated_across_types_become_qualified_labels(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(repeated_names=True)
    assert "item:x0" in graph.training.entity_to_id and "tag:x0" in graph.training.entity_to_id
    pbg.write(graph, tmp_path)
    names = json.loads((tmp_path / "entity_names_tag_0.json").read_text())
    assert names[:2] == ["x0", "x1"]  # PyTorch-BigGraph's names, per type
    assert_same_graph(graph, pbg.read(tmp_path, config=_config(graph, tmp_path)))


def _config(graph: TypedGraph, directory: pathlib.Path, **changes) -> dict:
    config = pbg.graph_config(graph, dict(dimension=4, operator="diagonal", comparator="dot"), checkpoint_path="c")
    config["entity_path"] = str(directory)
    config["edge_paths"] = [str(directory / name) for name in graph.splits]
    config.update(changes)
    return config


def test_importers_missing_bucket_files_are_empty_buckets(tmp_path: pathlib.Path) -> None:
    """PyTorch-BigGraph's TSV importer writes no file for an empty bucket: reading treats it as empty."""
    graph = typed_graph(2)
    pbg.write(graph, tmp_path)
    removed = tmp_path / "testing" / "edges_1_1.h5"
    with h5py.File(removed) as file:
        lost = file["lhs"].shape[0]
    removed.unlink()
    again = pbg.read(tmp_path, config=_config(graph, tmp_path))
    assert again.testing.num_triples == graph.testing.num_triples - lost


# -- bad input: clear errors naming the file --------------------------------------------------------


@pytest.fixture()
def written(tmp_path: pathlib.Path) -> tuple[TypedGraph, pathlib.Path]:
    graph = typed_graph(2)
    pbg.write(graph, tmp_path)
    return graph, tmp_path


def test_missing_count_file(written) -> None:
    graph, directory = written
    (directory / "entity_count_item_1.txt").unlink()
    with pytest.raises(FileNotFoundError, match="entity_count_item_1.txt is missing"):
        pbg.read(directory, config=_config(graph, directory))


def test_bucket_file_with_another_format_version(written) -> None:
    graph, directory = written
    path = directory / "training" / "edges_0_1.h5"
    with h5py.File(path, "a") as file:
        file.attrs["format_version"] = 2
    with pytest.raises(ValueError, match="edges_0_1.h5 has format_version=2"):
        pbg.read(directory, config=_config(graph, directory))


def test_out_of_range_offsets(written) -> None:
    graph, directory = written
    path = directory / "validation" / "edges_1_0.h5"
    with h5py.File(path, "a") as file:
        rhs = file["rhs"][...]
        rhs[0] = 999
        del file["rhs"]
        file.create_dataset("rhs", data=rhs)
    with pytest.raises(ValueError, match=r"edges_1_0.h5: rhs offset 999 of edge 0 is outside \[0, \d+\)"):
        pbg.read(directory, config=_config(graph, directory))


def test_relation_ids_out_of_range(written) -> None:
    graph, directory = written
    path = directory / "training" / "edges_0_0.h5"
    with h5py.File(path, "a") as file:
        rel = file["rel"][...]
        rel[-1] = 17
        del file["rel"]
        file.create_dataset("rel", data=rel)
    with pytest.raises(ValueError, match="edges_0_0.h5: relation ids .* outside"):
        pbg.read(directory, config=_config(graph, directory))


def test_a_relation_whose_triples_violate_its_types(written) -> None:
    """The config says "follows" is user -> tag: its edges (user -> user) reach past the tags' partitions.

    (PyTorch-BigGraph's edge files hold offsets within the relation's types, so a violation shows as an
    offset outside the type's partition; for global-id triples ``TypedGraph.from_triples`` checks the types.)
    """
    graph, directory = written
    config = _config(graph, directory)
    follows = next(r for r in config["relations"] if r["name"] == "follows")
    follows["rhs"] = "tag"
    with pytest.raises(ValueError, match=r"training/edges_\d_\d.h5: rhs offset \d+ of edge \d+ is outside .* 'tag'"):
        pbg.read(directory, config=config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["entities"]["item"].update(featurized=True), "featurized"),
        (lambda c: c["relations"][0].update(weight=-0.5), "finite, non-negative"),
        (lambda c: c["relations"][1].update(all_negs=True), "all_negs"),
        (lambda c: c["relations"][1].update(operator="rotation"), "operator 'rotation'"),
        (lambda c: c.update(comparator="cosine"), "comparator 'cosine'"),
        (lambda c: c["relations"][0].update(lhs="nobody"), "not one of the entity types"),
        (lambda c: c.pop("dimension"), "lacks the required PyTorch-BigGraph keys"),
        (lambda c: c.update(num_epoch=5), r"unknown PyTorch-BigGraph keys 'num_epoch' \(did you mean 'num_epochs'\?\)"),
        (lambda c: c["entities"]["item"].update(partitions=2), r"entity type 'item': unknown .* 'partitions'"),
        (lambda c: c["relations"][0].update(operater="none"), r"relation '\w+': unknown .* 'operater'"),
        (lambda c: c["entities"]["item"].update(dimension=3), r"dimensions of their own \{'item': 3\}"),
    ],
)
def test_what_pykeen_cannot_express_is_refused(written, change, message) -> None:
    graph, directory = written
    config = _config(graph, directory)
    change(config)
    with pytest.raises(ValueError, match=message):
        pbg.read(directory, config=config)


def test_repartition_per_type() -> None:
    """One count per type: the partitioned types share it (PyTorch-BigGraph's rule), the others keep one partition."""
    graph = typed_graph(1)
    mixed = graph.repartition([3, 1, 3], seed=1)
    assert [len(sizes) for sizes in mixed.schema.partition_sizes] == [3, 1, 3]
    assert [sum(sizes) for sizes in mixed.schema.partition_sizes] == [sum(s) for s in graph.schema.partition_sizes]
    assert mixed.training.num_triples == graph.training.num_triples
    # the same shuffles as one count for all types where every type is partitioned
    assert mixed.schema.partition_sizes[0] == graph.repartition(3, seed=1).schema.partition_sizes[0]
    with pytest.raises(ValueError, match="one count or one per entity type"):
        graph.repartition([2, 2])
    with pytest.raises(ValueError, match="same number of partitions"):
        graph.repartition([2, 3, 1])


def test_keys_of_later_pbg_versions_are_read(written) -> None:
    """Keys PyTorch-BigGraph added after 1.0 (GPU training, a type's own dimension equal to the config's) are read."""
    graph, directory = written
    config = _config(graph, directory)
    config.update(num_gpus=1, half_precision=False, num_groups_for_partition_server=8)
    config["entities"]["item"]["dimension"] = config["dimension"]
    again = pbg.read(directory, config=config)
    assert again.schema.partition_sizes == graph.schema.partition_sizes
    assert again.config is not None and again.config["num_gpus"] == 1


def test_featurized_edge_files_are_refused(written) -> None:
    graph, directory = written
    with h5py.File(directory / "training" / "edges_0_0.h5", "a") as file:
        file.create_dataset("lhsd_offsets", data=np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="edges_0_0.h5 holds featurized edges"):
        pbg.read(directory, config=_config(graph, directory))


def test_a_missing_edge_path(written) -> None:
    graph, directory = written
    config = _config(graph, directory)
    config["edge_paths"][1] = str(directory / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere not found"):
        pbg.read(directory, config=config)


# -- the pre-release layout (seed 003) --------------------------------------------------------------


def write_legacy(graph: TypedGraph, directory: pathlib.Path) -> dict:
    """Write the seed-003 layout: pickled counts, 1-based partitions and offsets, no format_version."""
    schema = graph.schema
    for t, name in enumerate(schema.entity_types):
        for p, size in enumerate(schema.partition_sizes[t]):
            torch.save(size, directory / f"entity_count_{name}_{p + 1}.pt")
    for split, factory in graph.splits.items():
        (directory / split).mkdir()
        triples = factory.mapped_triples
        heads, relations, tails = triples.unbind(1)
        parts = schema.num_partitions
        for lhs in range(parts):
            for rhs in range(parts):
                keep = (schema.entity_partition[heads] == lhs) & (schema.entity_partition[tails] == rhs)
                with h5py.File(directory / split / f"edges_{lhs + 1}_{rhs + 1}.h5", "w") as file:
                    file.create_dataset("lhs", data=(schema.entity_offset[heads[keep]] + 1).numpy())
                    file.create_dataset("rhs", data=(schema.entity_offset[tails[keep]] + 1).numpy())
                    file.create_dataset("rel", data=relations[keep].numpy())
    types = schema.entity_types
    return {
        "entities": {name: {"numPartitions": schema.num_partitions} for name in types},
        "relations": [
            {"name": n, "lhs": types[lhs], "rhs": types[rhs], "operator": "diagonal"}
            for n, lhs, rhs in zip(schema.relation_names, schema.relation_lhs, schema.relation_rhs)
        ],
        "entityPath": str(directory),
        "edgePaths": [str(directory / split) for split in graph.splits],
        "outdir": str(directory / "model"),
        "dimension": 4,
        "comparator": "dot",
    }


def test_the_pre_release_layout_is_read_as_a_legacy_import(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(2)
    config = write_legacy(graph, tmp_path)
    again = pbg.read(tmp_path, config=config)
    assert again.schema.partition_sizes == graph.schema.partition_sizes
    assert again.training.num_entities == graph.training.num_entities
    for name, factory in graph.splits.items():  # the layout has no names: compare by ids
        assert sorted(map(tuple, again.splits[name].mapped_triples.tolist())) == sorted(
            map(tuple, factory.mapped_triples.tolist())
        )
    assert load_config(config)["checkpoint_path"] == str(tmp_path / "model")  # outdir


def test_legacy_missing_count_file(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(2)
    config = write_legacy(graph, tmp_path)
    (tmp_path / "entity_count_tag_2.pt").unlink()
    with pytest.raises(FileNotFoundError, match="entity_count_tag_2.pt is missing"):
        pbg.read(tmp_path, config=config)


# -- TSV import --------------------------------------------------------------------------------------


def test_tsv_import_equals_pykeen(tmp_path: pathlib.Path) -> None:
    dataset = Nations()
    paths = {}
    for name, factory in (("train", dataset.training), ("valid", dataset.validation), ("test", dataset.testing)):
        paths[name] = tmp_path / f"{name}.txt"
        np.savetxt(paths[name], factory.label_triples(factory.mapped_triples), fmt="%s", delimiter="\t")
    graph = pbg.import_tsv(paths["train"], paths["valid"], paths["test"])
    reference = TriplesFactory.from_path(paths["train"])
    # PyKEEN's ids: labels sorted
    assert graph.training.entity_to_id == reference.entity_to_id
    assert graph.training.relation_to_id == reference.relation_to_id
    assert sorted(map(tuple, graph.training.mapped_triples.tolist())) == sorted(
        map(tuple, reference.mapped_triples.tolist())
    )
    assert labeled(graph.testing) == labeled(dataset.testing)
    partitioned = pbg.import_tsv(paths["train"], testing=paths["test"], num_partitions=2, seed=3)
    assert partitioned.schema.partition_sizes == ((7, 7),)
    assert labeled(partitioned.training) == labeled(reference)


def test_typed_tsv_import_with_a_config(tmp_path: pathlib.Path) -> None:
    graph = typed_graph(repeated_names=True)
    path = tmp_path / "edges.tsv"
    labels = graph.training.label_triples(graph.training.mapped_triples)
    names = labels.copy()  # PyTorch-BigGraph's TSV has names, not labels
    types = graph.schema.entity_type[graph.training.mapped_triples[:, [0, 2]]].numpy()
    names[:, [0, 2]] = np.vectorize(graph.schema.name_of)(types, labels[:, [0, 2]])
    np.savetxt(path, names, fmt="%s", delimiter="\t")
    config = _config(graph, tmp_path)
    imported = pbg.import_tsv(path, config=config)
    assert imported.schema.qualified_labels  # names repeat across item and tag
    used = set(graph.training.mapped_triples[:, [0, 2]].reshape(-1).tolist())
    assert imported.training.num_entities == len(used)  # only the entities the file mentions
    assert labeled(imported.training) == labeled(graph.training)
    imported.schema.check_triples(imported.training.mapped_triples)
    with open(path, "a") as file:
        file.write("u1\tsells\ti2\n")
    with pytest.raises(ValueError, match=r"edges.tsv: relations \['sells'\] are not in the config"):
        pbg.import_tsv(path, config=config)
    # a config without paths (an import writes its own); its partitions, unless num_partitions says otherwise
    for key in ("entity_path", "edge_paths", "checkpoint_path"):
        del config[key]
    config["entities"] = {name: {"num_partitions": 2} for name in config["entities"]}
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")  # without the unknown relation again
    for given, expected in ((None, 2), (3, 3)):
        imported = pbg.import_tsv(path, config=config, num_partitions=given)
        assert all(len(sizes) == expected for sizes in imported.schema.partition_sizes)
    config["entities"][graph.schema.entity_types[0]]["num_partitions"] = 1  # PBG's rule: imported per type
    imported = pbg.import_tsv(path, config=config)
    assert [len(sizes) for sizes in imported.schema.partition_sizes] == [1, 2, 2]
    config["entities"][graph.schema.entity_types[0]]["num_partitions"] = 3
    with pytest.raises(ValueError, match=r"into different numbers of partitions"):
        pbg.import_tsv(path, config=config)


def test_tsv_with_too_few_columns(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text("a\tr\tb\nc\td\n")
    with pytest.raises(ValueError, match="bad.tsv: not a file of 3"):
        pbg.import_tsv(path)


def test_tsv_with_more_columns_reads_the_given_ones(tmp_path: pathlib.Path) -> None:
    """A weight column (PyTorch-BigGraph's importer and PyKEEN read such files): the given columns are the triples."""
    path = tmp_path / "weighted.tsv"
    path.write_text("a\tr\tb\t0.5\nb\tr\tc\t0.7\n")
    graph = pbg.import_tsv(path, columns=(0, 1, 2))
    assert sorted(map(tuple, graph.training.label_triples(graph.training.mapped_triples).tolist())) == [
        ("a", "r", "b"),
        ("b", "r", "c"),
    ]
    swapped = pbg.import_tsv(path, columns=(2, 1, 0))
    assert sorted(map(tuple, swapped.training.label_triples(swapped.training.mapped_triples).tolist())) == [
        ("b", "r", "a"),
        ("c", "r", "b"),
    ]
    (tmp_path / "ragged.tsv").write_text("a\tr\tb\t0.5\nb\tr\tc\n")
    with pytest.raises(ValueError, match="ragged.tsv: not a file of 4"):
        pbg.import_tsv(tmp_path / "ragged.tsv")


def test_checkpoint_datasets_carry_digests_checked_on_read(tmp_path: pathlib.Path) -> None:
    """A changed value in an embeddings or model file is refused naming the file; PyTorch-BigGraph's own files pass."""
    from pykeen_bess import CorruptCheckpointError
    from pykeen_bess.pbg import files

    rows = torch.randn(30, 4)
    embeddings, model = tmp_path / "embeddings_all_0.v1.h5", tmp_path / "model.v1.h5"
    files.write_embeddings(embeddings, rows, {"state": {0: {"step": 0, "sum": torch.ones(30)}}})
    files.write_model(model, {"relations/0/operator/rhs/diagonal": torch.ones(4)})
    assert torch.equal(files.read_embeddings(embeddings)[0], rows)
    assert set(files.read_model(model)) == {"relations/0/operator/rhs/diagonal"}
    for file, dataset in ((embeddings, "embeddings"), (model, "model/relations/0/operator/rhs/diagonal")):
        with h5py.File(file, "r+") as h5:
            h5[dataset][0] = h5[dataset][0] + 1
        with pytest.raises(CorruptCheckpointError, match=rf"{file.name} is corrupted: dataset '/{dataset}'"):
            (files.read_embeddings if file is embeddings else files.read_model)(file)
        with h5py.File(file, "r+") as h5:  # as PyTorch-BigGraph writes it: no digest
            del h5[dataset].attrs["pykeen_bess_crc32"]
        (files.read_embeddings if file is embeddings else files.read_model)(file)
