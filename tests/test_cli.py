"""The command line: flags for what the README's pipeline() example sets, config files, errors as messages."""

from __future__ import annotations

import contextlib
import json
import re
import logging
import pathlib

import pytest
import torch

from pykeen_bess.cli import build_parser, main, pipeline_kwargs
from pykeen_bess.training import BessTrainingLoop

FAST = ["--dim", "8", "--epochs", "2", "--batch-size", "128", "--negatives", "8", "--quiet", "--json"]


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_is_plain_text() -> None:
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    for text in (parser.format_help(), train.format_help()):
        assert "``" not in text and ":mod:" not in text and ":class:" not in text


@pytest.mark.parametrize(
    ("arguments", "status"),
    [(["--help"], 0), (["train", "--help"], 0), (["pbg", "import", "--help"], 0), (["train", "--exchange", "foo"], 2)],
)
def test_help_and_argument_errors_come_before_torch_and_pykeen_are_imported(arguments: list[str], status: int) -> None:
    """``--help`` and a bad option answer at once: the parser imports neither torch nor PyKEEN (seconds each)."""
    import subprocess
    import sys

    code = (
        "import runpy, sys\n"
        f"sys.argv = ['pykeen-bess', *{arguments!r}]\n"
        "try:\n"
        "    runpy.run_module('pykeen_bess', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print('exit', exit.code, 'torch' in sys.modules, 'pykeen' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stderr.strip().splitlines()[-1] == f"exit {status} False False", result.stderr


def test_without_verbose_pykeen_logs_warnings_only() -> None:
    """Importing PyKEEN sets its logger to INFO; the command line sets the level after that import (a fresh process)."""
    import subprocess
    import sys

    code = (
        "import logging\n"
        "from pykeen_bess.cli import _configure_logging\n"
        "_configure_logging(False)\n"
        "import pykeen.pipeline\n"
        "print(logging.getLogger('pykeen.triples.triples_factory').isEnabledFor(logging.INFO))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "False", result.stderr


def test_the_device_is_one_torch_has(capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """Without --device: CUDA where torch sees it, else the CPU without PyKEEN's warning; a CUDA device it lacks is
    a usage error before any work (PyKEEN would train on the CPU instead)."""
    import torch

    from pykeen_bess.cli import _available_device

    assert _available_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert _available_device("cpu") == "cpu"
    if torch.cuda.is_available():
        return
    code, out, err = run(capsys, "--dataset", "nations", *FAST)
    assert code == 0 and "No cuda devices" not in err
    assert not [record for record in caplog.records if "No cuda devices" in record.getMessage()]
    for device in ("cuda", "cuda:0", "gpu"):
        code, out, err = run(capsys, "--dataset", "nations", "--device", device, *FAST)
        assert code == 2 and f"--device {device}: torch sees no CUDA device" in err and not out


def test_lr_help_says_the_default_differs_from_pipeline() -> None:
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    text = " ".join(train.format_help().split())
    assert "default: 0.01, ten times pipeline()'s" in text and "0.001" in text


#: what the command line adds to the loop's (and the bess evaluator's) arguments unless told otherwise
HOST = dict(num_threads="auto", host_allocator="auto")


def test_the_readme_pipeline_example_from_the_command_line() -> None:
    """README: DistMult d64, 4 shards, embedding exchange, ht corruption, 64 negatives, 100 epochs, batch 512."""
    args = build_parser().parse_args(
        ["train", "--dataset", "nations", "--model", "DistMult", "--dim", "64", "--num-shards", "4"]
        + ["--exchange", "embedding", "--corruption", "ht", "--negatives", "64", "--epochs", "100"]
        + ["--batch-size", "512", "--evaluator", "bess", "--output", "out"]
    )
    kwargs = pipeline_kwargs(args)
    assert kwargs["model"] == "DistMult" and kwargs["model_kwargs"] == dict(embedding_dim=64)
    assert kwargs["training_loop"] is BessTrainingLoop
    assert kwargs["training_loop_kwargs"] == dict(num_shards=4, exchange="embedding", corruption="ht", **HOST)
    assert kwargs["negative_sampler_kwargs"] == dict(num_negs_per_pos=64)
    assert kwargs["training_kwargs"]["num_epochs"] == 100 and kwargs["training_kwargs"]["batch_size"] == 512
    assert kwargs["evaluator"] == "bess"


def test_errors_are_one_message_with_exit_status_2(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, *FAST, "--optimizer", "rmsprop")
    assert code == 2 and out == ""
    assert "pykeen-bess: error:" in err and "--dense-updates" in err and "Traceback" not in err
    # --verbose shows the traceback
    code, _, err = run(capsys, *FAST, "--optimizer", "rmsprop", "--verbose")
    assert code == 2 and "Traceback" in err
    code, _, err = run(capsys, *FAST, "--dataset", "no-such-dataset")
    assert code == 2 and "Unknown dataset 'no-such-dataset'" in err and "Traceback" not in err
    # a path is a path: not looked up among PyKEEN's dataset names
    for path, what in (("./no-such-dir", "no directory with"), (__file__, "a file, not a directory of")):
        code, _, err = run(capsys, *FAST, "--dataset", path)
        assert code == 2 and f"--dataset {path}: {what} train.txt" in err and "Valid choices" not in err, err
    code, _, err = run(capsys, *FAST, "--batch-size", "-3")
    assert code == 2 and "batch_size must be a positive integer" in err
    # a checkpoint directory without a checkpoint name would train without checkpoints
    for option in (["--checkpoint-directory", "ckpt"], ["--checkpoint-frequency", "0"]):
        code, _, err = run(capsys, *FAST, *option)
        assert code == 2 and "need --checkpoint-name" in err


@pytest.mark.parametrize("bad", ["Y\tR", "Y\tR\tZ\tW"], ids=["two columns", "four columns"])
def test_dataset_directory_lines_need_three_columns(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path, bad: str
) -> None:
    """A label TSV line with two or four columns is refused, naming the file and the line."""
    lines = ["a\tr\tb", "b\tr\tc", "c\ts\ta", "", "a\ts\tc"]
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("\n".join([*lines[:2], bad, *lines[2:]]) + "\n", encoding="utf-8")
    code, out, err = run(capsys, *FAST, "--dataset", str(tmp_path))
    columns = bad.count("\t") + 1
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"{tmp_path / 'valid.txt'}, line 3: {columns} tab-separated columns, expected 3" in err
    # CRLF line ends and blank lines are fine
    (tmp_path / "valid.txt").write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    from pykeen_bess.cli import load_dataset

    assert load_dataset(str(tmp_path)).validation.num_triples == 4


def test_bad_json_options_are_usage_errors(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model-kwargs", "{not json"])
    assert exit_info.value.code == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ("\tr\tb", "the head label '' is empty"),
        ("a\tr \tb", "the relation label 'r ' has spaces around it"),
        ('a\tr\t"b', "the tail label '\"b' holds a double quote"),
    ],
    ids=["empty", "spaces", "quote"],
)
def test_dataset_directory_labels_are_refused_before_pykeen_misreads_them(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path, bad: str, problem: str
) -> None:
    """Labels PyKEEN would read as an entity '', as another label, or as quoting; an empty file: named, refused."""
    lines = ["a\tr\tb", "b\tr\tc", "c\ts\ta"]
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "train.txt").write_text("\n".join([*lines, bad]) + "\n", encoding="utf-8")
    code, _, err = run(capsys, *FAST, "--dataset", str(tmp_path))
    assert code == 2 and f"{tmp_path / 'train.txt'}, line 4: {problem}" in err
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "test.txt").write_text("\n", encoding="utf-8")
    code, _, err = run(capsys, *FAST, "--dataset", str(tmp_path))
    assert code == 2 and f"{tmp_path / 'test.txt'} holds no triples" in err


def test_dense_updates_allow_any_optimizer_and_the_model_is_saved(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path
) -> None:
    code, out, err = run(
        capsys, *FAST, "--optimizer", "rmsprop", "--dense-updates", "--output", str(tmp_path / "model")
    )
    assert code == 0, err
    first = out
    assert 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
    assert (tmp_path / "model" / "trained_model.pkl").is_file()
    # metadata.json records what the run used
    metadata = json.loads((tmp_path / "model" / "metadata.json").read_text())
    assert metadata["pykeen_bess_version"] and metadata["pykeen_version"] and metadata["torch_version"]
    used = metadata["pipeline"]
    assert used["dataset"] == "nations" and used["model"] == "DistMult" and used["optimizer"] == "rmsprop"
    assert used["training_loop"] == "pykeen_bess.training.loop.BessTrainingLoop"
    assert used["training_kwargs"]["num_epochs"] == 2 and used["training_loop_kwargs"]["sparse_updates"] is False
    assert used["optimizer_kwargs"] == {"lr": 0.01} and used["random_seed"] == 42
    # ... and runs again as a configuration (the loop by its qualified name)
    code, out, err = run(capsys, "--config", str(tmp_path / "model" / "metadata.json"), "--quiet", "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads(first)


def test_checkpoints_early_stopping_and_evaluator_options(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path
) -> None:
    options = [
        *FAST,
        "--checkpoint-name",
        "run.pt",
        "--checkpoint-directory",
        str(tmp_path),
        "--checkpoint-frequency",
        "0",
        "--early-stopping",
        "--stopper-frequency",
        "1",
        "--stopper-patience",
        "1",
        "--eval-batch-size",
        "16",
        "--eval-slice-size",
        "5",
        "--exchange",
        "score",
    ]
    code, out, err = run(capsys, *options)
    assert code == 0, err
    assert (tmp_path / "run.pt").is_file() and "resumed" not in err
    first = json.loads(out)
    # the same command again resumes the finished checkpoint: no more training, the same metrics, and it says so
    code, out, err = run(capsys, *options)
    assert code == 0, err
    assert json.loads(out) == pytest.approx(first)
    assert f"resumed the checkpoint {tmp_path / 'run.pt'}: trained to epoch" in err


def test_config_file_amended_by_flags(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    config = dict(
        metadata=dict(title="bess"),
        pipeline=dict(
            dataset="nations",
            model="TransE",
            model_kwargs=dict(embedding_dim=8, scoring_fct_norm=2),
            training_loop="bess",
            training_loop_kwargs=dict(num_shards=2),
            negative_sampler_kwargs=dict(num_negs_per_pos=4),
            training_kwargs=dict(num_epochs=50, batch_size=64),
            random_seed=1,
        ),
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = build_parser().parse_args(["train", "--config", str(path), "--epochs", "1", "--dim", "4"])
    kwargs = pipeline_kwargs(args)
    assert kwargs["model"] == "TransE"
    assert kwargs["model_kwargs"] == dict(embedding_dim=4, scoring_fct_norm=2)
    assert kwargs["training_kwargs"]["num_epochs"] == 1 and kwargs["training_kwargs"]["batch_size"] == 64
    assert kwargs["training_loop_kwargs"] == dict(num_shards=2, **HOST)
    code, out, err = run(capsys, "--config", str(path), "--epochs", "1", "--quiet", "--json")
    assert code == 0, err
    assert 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
    # a configuration for another training loop is refused
    path.write_text(json.dumps(dict(pipeline=dict(config["pipeline"], training_loop="slcwa"))))
    code, _, err = run(capsys, "--config", str(path))
    assert code == 2 and "trains with BESS only" in err


def test_replica_flags(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    args = build_parser().parse_args(
        ["train", "--num-shards", "2", "--replicas", "2", "--replica-grouping", "consecutive"]
        + ["--checkpoint-retrieval", "all_replicas"]
    )
    assert pipeline_kwargs(args)["training_loop_kwargs"] == dict(
        num_shards=2,
        replicas=2,
        replica_grouping="consecutive",
        checkpoint_retrieval="all_replicas",
        corruption="ht",
        **HOST,
    )
    # the same from a configuration file
    config = tmp_path / "config.json"
    loop_kwargs = dict(num_shards=1, replicas=4, replica_grouping="all", checkpoint_retrieval="all_replicas")
    config.write_text(json.dumps(dict(pipeline=dict(dataset="nations", training_loop_kwargs=loop_kwargs))))
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config)]))
    assert kwargs["training_loop_kwargs"] == dict(loop_kwargs, **HOST)
    # outside torchrun there is no process group to hold replicas: one line, exit status 2, before training
    code, out, err = run(capsys, *FAST, "--replicas", "2", "--output", str(tmp_path / "out"))
    assert code == 2 and out == ""
    assert "need a process group of several ranks (torchrun)" in err and "Traceback" not in err


def test_storage_flags_train_with_tables_in_files(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    args = build_parser().parse_args(["train", "--storage", "mmap", "--storage-path", str(tmp_path)])
    loop_kwargs = pipeline_kwargs(args)["training_loop_kwargs"]
    assert loop_kwargs["storage"] == "mmap" and loop_kwargs["storage_path"] == str(tmp_path)
    tables = tmp_path / "tables"
    tables.mkdir()
    code, out, err = run(capsys, *FAST, "--storage", "mmap", "--storage-path", str(tables))
    assert code == 0, err
    assert 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
    assert sorted(p.name for p in tables.iterdir())  # the tables (and their state) were files
    # a missing directory: one line, exit status 2
    code, out, err = run(capsys, *FAST, "--storage", "mmap", "--storage-path", str(tmp_path / "missing"))
    assert code == 2 and "is not a directory" in err and "Traceback" not in err


def test_encoding_partition_from_the_command_line(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    args = build_parser().parse_args(["train", "--num-shards", "3", "--partition", "encoding"])
    assert pipeline_kwargs(args)["training_loop_kwargs"] == dict(
        num_shards=3, partition="encoding", corruption="ht", **HOST
    )
    code, out, err = run(capsys, *FAST, "--num-shards", "3", "--partition", "encoding", "--output", str(tmp_path / "o"))
    assert code == 0, err
    assert 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
    code, _, err = run(capsys, *FAST, "--partition", "encoding", "--exchange", "score")
    assert code == 2 and "works on the 'token' partition" in err


def test_threads_flag(capsys: pytest.CaptureFixture) -> None:
    """--threads sets the loop's and the bess evaluator's num_threads; bad values are usage errors."""
    for value, expected in (("auto", "auto"), ("1", 1), ("keep", None)):
        kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--threads", value]))
        assert kwargs["training_loop_kwargs"]["num_threads"] == expected
        assert kwargs["evaluator_kwargs"]["num_threads"] == expected
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--threads", "1", "--evaluator", "rankbased"]))
    assert "num_threads" not in kwargs.get("evaluator_kwargs", {})
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--threads", "0"])
    assert exit_info.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_sharding_flag() -> None:
    """--sharding reaches the loop; without it the loop's default (balanced) applies."""
    for value in ("balanced", "random"):
        kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--sharding", value]))
        assert kwargs["training_loop_kwargs"]["sharding"] == value
    assert "sharding" not in pipeline_kwargs(build_parser().parse_args(["train"]))["training_loop_kwargs"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--sharding", "rows"])


def test_loss_weighter_flag(capsys: pytest.CaptureFixture) -> None:
    """--loss-weighter reaches the loop (Sun et al.'s subsampling with the weighted NSSA loss) and trains."""
    arguments = ["--dataset", "nations", "--loss", "weightednssa", "--loss-weighter", "subsampling"]
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", *arguments]))
    assert kwargs["training_loop_kwargs"]["loss_weighter"] == "subsampling" and kwargs["loss"] == "weightednssa"
    assert "loss_weighter" not in pipeline_kwargs(build_parser().parse_args(["train"]))["training_loop_kwargs"]
    code, out, _ = run(capsys, *arguments, *FAST)
    assert code == 0 and 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
    code, _, err = run(capsys, *arguments[:2], "--loss-weighter", "nosuch", *FAST)
    assert code == 2 and "nosuch" in err


def test_default_negatives_fit_any_shard_count(capsys: pytest.CaptureFixture) -> None:
    """Without --negatives the loop's default applies: 64 rounded up to a multiple of the shards (66 for 3)."""
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--num-shards", "3"]))
    assert "num_negs_per_pos" not in kwargs.get("negative_sampler_kwargs", {})
    code, out, err = run(capsys, "--num-shards", "3", "--dim", "8", "--epochs", "1", "--batch-size", "128", "--quiet",
                         "--json")  # fmt: skip
    assert code == 0, err
    assert 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1


def test_negatives_flags(capsys: pytest.CaptureFixture) -> None:
    """--block-negatives draws per block, --step-negatives (the default) per step; with --typed-negatives typed."""

    def negatives(*flags: str) -> str | None:
        return pipeline_kwargs(build_parser().parse_args(["train", *flags]))["training_loop_kwargs"].get("negatives")

    assert negatives() is None  # the loop's default, one set per step
    assert negatives("--step-negatives") == "step"
    assert negatives("--block-negatives") == "block"
    assert negatives("--typed-negatives") == negatives("--typed-negatives", "--step-negatives") == "typed_step"
    assert negatives("--typed-negatives", "--block-negatives") == "typed"
    with pytest.raises(SystemExit):  # argparse refuses both spreads
        build_parser().parse_args(["train", "--block-negatives", "--step-negatives"])
    code, out, _ = run(capsys, "--dataset", "nations", "--num-shards", "2", "--block-negatives", *FAST)
    assert code == 0 and 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1


def test_host_allocator_flag() -> None:
    """--host-allocator sets the loop's and the bess evaluator's host_allocator (keep: None)."""
    for value, expected in (("auto", "auto"), ("keep", None)):
        kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--host-allocator", value]))
        assert kwargs["training_loop_kwargs"]["host_allocator"] == expected
        assert kwargs["evaluator_kwargs"]["host_allocator"] == expected
    arguments = ["train", "--host-allocator", "keep", "--evaluator", "rankbased"]
    kwargs = pipeline_kwargs(build_parser().parse_args(arguments))
    assert "host_allocator" not in kwargs.get("evaluator_kwargs", {})


def test_command_line_turns_threads_and_allocator_on(tmp_path: pathlib.Path) -> None:
    """The library measures the threads (restored afterwards) but leaves the process-wide allocator alone by default;
    the command line asks for both unless told otherwise."""
    import inspect

    from pykeen_bess import BessEvaluator, BessTrainingLoop

    for cls in (BessTrainingLoop, BessEvaluator):
        parameters = inspect.signature(cls.__init__).parameters
        assert parameters["num_threads"].default == "auto" and parameters["host_allocator"].default is None
    kwargs = pipeline_kwargs(build_parser().parse_args(["train"]))
    for key in ("training_loop_kwargs", "evaluator_kwargs"):
        assert kwargs[key]["num_threads"] == kwargs[key]["host_allocator"] == "auto"
    # a configuration's own setting wins over the command line's default; an option wins over both
    config = tmp_path / "config.json"
    pipeline = {"dataset": "nations", "evaluator": "bess", "training_loop_kwargs": {"num_threads": 1}}
    config.write_text(json.dumps({"pipeline": pipeline}))
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config)]))
    assert kwargs["training_loop_kwargs"]["num_threads"] == 1 and kwargs["evaluator_kwargs"]["num_threads"] == "auto"
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config), "--threads", "2"]))
    assert kwargs["training_loop_kwargs"]["num_threads"] == kwargs["evaluator_kwargs"]["num_threads"] == 2
    # without an evaluator a configuration gets PyKEEN's rank-based one, which takes neither setting
    config.write_text(json.dumps({"pipeline": {"dataset": "nations"}}))
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config)]))
    assert "evaluator_kwargs" not in kwargs and kwargs["training_loop_kwargs"]["host_allocator"] == "auto"


def test_pytorch_biggraph_import_train_and_export(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    """TSV files -> a PBG input directory -> BESS training with PBG-layout checkpoints -> a PBG checkpoint."""
    import numpy as np
    from pykeen.datasets import Nations

    from pykeen_bess import pbg

    dataset = Nations()
    files = []
    for name, factory in (("train", dataset.training), ("valid", dataset.validation), ("test", dataset.testing)):
        files.append(tmp_path / f"{name}.tsv")
        np.savetxt(files[-1], factory.label_triples(factory.mapped_triples), fmt="%s", delimiter="\t")
    data = tmp_path / "data"
    assert (
        main(["pbg", "import", *map(str, files), "--output", str(data), "--partitions", "2", "--model", "ComplEx"]) == 0
    )
    assert "entity: 14 in 2 partitions" in capsys.readouterr().out
    config = json.loads((data / "config.json").read_text())
    assert config["relations"][0]["operator"] == "complex_diagonal" and config["dimension"] == 200
    code, out, err = run(
        capsys,
        "--pbg", str(data), "--num-shards", "2", "--typed-negatives", "--dim", "4", "--epochs", "2", "--quiet",
        "--json", "--checkpoint-format", "pbg", "--checkpoint-directory", str(tmp_path / "ckpt"),
        "--checkpoint-name", "bess.pt", "--optimizer", "rowwise_adagrad", "--lr", "0.1",
        "--export-pbg", str(tmp_path / "export"), "--output", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 0 and "resumed" not in err, err
    assert 0 < json.loads(out)["both.realistic.inverse_harmonic_mean_rank"] <= 1
    assert pbg.files.read_version(tmp_path / "ckpt") == 2 and pbg.files.read_version(tmp_path / "export") == 2
    graph = pbg.read(data)
    model = pbg.read_checkpoint(tmp_path / "export", graph)
    assert type(model).__name__ == "ComplEx"  # the config's operator and comparator
    assert main(["pbg", "export", "--model", str(tmp_path / "out" / "trained_model.pkl"), "--graph", str(data),
                 "--output", str(tmp_path / "again"), "--version", "2"]) == 0  # fmt: skip
    capsys.readouterr()
    again = pbg.read_checkpoint(tmp_path / "again", graph)
    torch.testing.assert_close(again.entity_representations[0](None), model.entity_representations[0](None))
    # a model of the same label files read as a dataset (PyKEEN's sorted ids, not the partitions'): refused, not
    # exported with every vector under another entity's label
    for name, file in zip(("train", "valid", "test"), files):
        (tmp_path / "tsv").mkdir(exist_ok=True)
        (tmp_path / "tsv" / f"{name}.txt").write_text(file.read_text())
    code, _, err = run(capsys, *FAST, "--dataset", str(tmp_path / "tsv"), "--model", "ComplEx", "--epochs", "1",
                       "--output", str(tmp_path / "as-dataset"))  # fmt: skip
    assert code == 0, err
    assert main(["pbg", "export", "--model", str(tmp_path / "as-dataset" / "trained_model.pkl"), "--graph",
                 str(data), "--output", str(tmp_path / "wrong")]) == 2  # fmt: skip
    assert "The model's entity ids are not the graph's (id 0:" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()


def test_pytorch_biggraph_import_writes_the_config_of_its_partitions(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path
) -> None:
    """With a config, the partitions default to the config's (per type); config.json names the partitions written."""
    from pykeen_bess import pbg

    lines = [f"u{i}\tlikes\ti{(7 * i) % 30}" for i in range(40)] + [f"u{i}\tknows\tu{(i + 1) % 40}" for i in range(40)]
    (tmp_path / "edges.tsv").write_text("\n".join(lines) + "\n")

    def config(partitions: int, items: int | None = None) -> pathlib.Path:
        path = tmp_path / f"config-{partitions}-{items}.json"
        entities = {"user": {"num_partitions": partitions}, "item": {"num_partitions": items or partitions}}
        relations = [
            {"name": "likes", "lhs": "user", "rhs": "item", "operator": "none"},
            {"name": "knows", "lhs": "user", "rhs": "user", "operator": "none"},
        ]
        paths = dict(entity_path="data", edge_paths=["data/edges"], checkpoint_path="model")
        path.write_text(json.dumps(dict(entities=entities, relations=relations, dimension=8, **paths)))
        return path

    for name, flags, expected in (("config", [], 2), ("flag", ["--partitions", "3"], 3)):
        data = tmp_path / name
        assert main(["pbg", "import", str(tmp_path / "edges.tsv"), "--config", str(config(2)), "--output", str(data),
                     *flags]) == 0  # fmt: skip
        capsys.readouterr()
        written = json.loads((data / "config.json").read_text())
        assert {t: e["num_partitions"] for t, e in written["entities"].items()} == {"user": expected, "item": expected}
        graph = pbg.read(data)  # every triple, read back through the written config
        assert sum(map(sum, graph.schema.partition_sizes)) == 40 + 30
        assert all(len(sizes) == expected for sizes in graph.schema.partition_sizes)
        assert graph.splits["training"].num_triples == 80
    # PyTorch-BigGraph's rule: the partitioned types share one count, the others have 1 (as its importer splits them)
    assert main(["pbg", "import", str(tmp_path / "edges.tsv"), "--config", str(config(2, 1)), "--output",
                 str(tmp_path / "mixed")]) == 0  # fmt: skip
    capsys.readouterr()
    written = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert {t: e["num_partitions"] for t, e in written["entities"].items()} == {"user": 2, "item": 1}
    graph = pbg.read(tmp_path / "mixed")
    assert [len(sizes) for sizes in graph.schema.partition_sizes] == [2, 1] and graph.training.num_triples == 80
    code = main(["pbg", "import", str(tmp_path / "edges.tsv"), "--config", str(config(3, 2)), "--output",
                 str(tmp_path / "unequal")])  # fmt: skip
    assert code == 2 and "give num_partitions (--partitions)" in capsys.readouterr().err


def test_train_pbg_names_the_config_training_settings_it_does_not_use(caplog: pytest.LogCaptureFixture) -> None:
    """PyTorch-BigGraph's epochs, learning rate, loss and negatives in the config are named, unless a flag sets them."""
    from pykeen_bess.cli.pbg import warn_untaken_settings
    from pykeen_bess.pbg.config import normalize_config

    config = normalize_config(
        dict(entities={"e": {"num_partitions": 1}}, relations=[dict(name="r", lhs="e", rhs="e")], dimension=8,
             num_epochs=50, lr=0.1, loss_fn="softmax", num_uniform_negs=1000, batch_size=1000, workers=4),
        paths=False,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pykeen_bess"):
        named = warn_untaken_settings(config, {"epochs": 3})
    assert named == ["lr=0.1", "loss_fn='softmax'", "num_uniform_negs=1000"]  # batch_size at PBG's default
    assert "--lr, --loss, --negatives" in caplog.text and "num_epochs" not in caplog.text
    # the learning rate's own flag decides it (the warning pointed to --optimizer-kwargs, and --lr did not count)
    assert "lr=0.1" not in warn_untaken_settings(config, {"epochs": 3, "lr": 0.01})
    assert (
        warn_untaken_settings(
            normalize_config(dict(config, lr=0.01, loss_fn="ranking", num_uniform_negs=50)), {"epochs": 3}
        )
        == []
    )


def test_pytorch_biggraph_command_errors(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    code, _, err = run(capsys, *FAST, "--pbg", str(tmp_path / "missing"))
    assert code == 2 and "input directory" in err and "does not exist" in err
    code, _, err = run(capsys, *FAST, "--pbg-config", str(tmp_path / "c.json"))
    assert code == 2 and "--pbg-config needs --pbg" in err
    code, _, err = run(capsys, *FAST, "--typed-negatives")
    assert code == 2 and "needs entity types" in err
    assert main(["pbg", "import", str(tmp_path / "nothing.tsv"), "--output", str(tmp_path / "o")]) == 2
    assert "nothing.tsv does not exist" in capsys.readouterr().err
    (tmp_path / "a.tsv").write_text("a\tr\tb\n")
    assert main(["pbg", "import", str(tmp_path / "a.tsv"), "--output", str(tmp_path / "o"), "--model", "PairRE"]) == 2
    assert "cannot express the model 'PairRE'" in capsys.readouterr().err


def test_static_step_flag_sets_the_loop_option() -> None:
    for value, expected in (("on", True), ("off", False)):
        kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--static-step", value]))
        assert kwargs["training_loop_kwargs"]["static_step"] is expected
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--static-step", "auto"]))
    assert kwargs["training_loop_kwargs"]["static_step"] is None


def test_a_config_keeps_the_loops_defaults_and_its_negatives_yield_to_the_flag(tmp_path: pathlib.Path) -> None:
    """A configuration trains as pipeline_from_path would (no command-line shard default); --negatives wins.

    HPO's best configurations hold ``training_kwargs.num_negs_per_pos``, which the loop's ``train`` reads.
    """
    path = tmp_path / "config.json"
    pipeline = dict(dataset="nations", model="DistMult", training_loop="bess", training_kwargs=dict(num_negs_per_pos=4))
    path.write_text(json.dumps(dict(pipeline=pipeline)))
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(path), "--negatives", "16"]))
    assert "num_shards" not in kwargs["training_loop_kwargs"]
    assert kwargs["training_kwargs"]["num_negs_per_pos"] == 16
    assert kwargs["negative_sampler_kwargs"]["num_negs_per_pos"] == 16
    assert pipeline_kwargs(build_parser().parse_args(["train"]))["training_loop_kwargs"]["num_shards"] == 2


def test_a_rerun_from_metadata_repeats_a_run_without_a_seed(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path
) -> None:
    """metadata.json records the seed pipeline() drew, so a configuration without one reruns the same."""
    path = tmp_path / "config.json"
    pipeline = dict(
        dataset="nations",
        model="DistMult",
        model_kwargs=dict(embedding_dim=8),
        training_loop="bess",
        training_kwargs=dict(num_epochs=2, batch_size=128),
    )
    path.write_text(json.dumps(dict(pipeline=pipeline)))
    code, first, err = run(capsys, "--config", str(path), "--output", str(tmp_path / "one"), "--quiet", "--json")
    assert code == 0, err
    seed = json.loads((tmp_path / "one" / "metadata.json").read_text())["pipeline"]["random_seed"]
    assert isinstance(seed, int)
    again = str(tmp_path / "one" / "metadata.json")
    code, second, err = run(capsys, "--config", again, "--output", str(tmp_path / "two"), "--quiet", "--json")
    assert code == 0, err
    assert json.loads(first) == json.loads(second)


def test_outputs_and_export_are_checked_before_training(capsys: pytest.CaptureFixture, tmp_path: pathlib.Path) -> None:
    """An output path that is a file, a model PyTorch-BigGraph cannot express, bad stopper values: before any epoch."""
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, *FAST, "--output", str(tmp_path / "file"))
    assert code == 2 and "--output" in err and "is a file" in err
    code, _, err = run(capsys, *FAST, "--export-pbg", str(tmp_path / "file"))
    assert code == 2 and "--export-pbg" in err and "is a file" in err
    losses: list[list[float]] = []
    original = BessTrainingLoop._train

    def recorded(self, *args, **kwargs):
        losses.append(original(self, *args, **kwargs))  # (not reached: refused)
        return losses[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BessTrainingLoop, "_train", recorded)
        code, _, err = run(capsys, *FAST, "--model", "TransE", "--export-pbg", str(tmp_path / "exported"))
    assert code == 2 and "--export-pbg: PyTorch-BigGraph cannot express TransE" in err and "p=1" in err
    assert losses == [] and not list((tmp_path / "exported").iterdir())  # refused when training started
    for flag, value, least in (("--stopper-frequency", "0", 1), ("--stopper-patience", "-1", 0)):
        code, _, err = run(capsys, *FAST, "--early-stopping", flag, value)
        assert code == 2 and f"{flag} must be at least {least}" in err
    # evaluation sizes too: they were checked when the evaluation started, after the whole training
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BessTrainingLoop, "_train", recorded)
        for flag, value in (("--eval-batch-size", "0"), ("--eval-slice-size", "-3")):
            code, _, err = run(capsys, *FAST, flag, value)
            assert code == 2 and f"{flag} must be at least 1, not {value}" in err
    assert losses == []


def test_storage_kwargs_and_memory_budget_flags(tmp_path: pathlib.Path) -> None:
    """Every loop option has a flag: the storage tier's options and the memory budget too."""
    args = build_parser().parse_args(
        ["train", "--storage", "mmap", "--storage-path", str(tmp_path), "--storage-kwargs", '{"overwrite": true}']
        + ["--memory-budget", "100000000"]
    )
    kwargs = pipeline_kwargs(args)
    loop = kwargs["training_loop_kwargs"]
    assert loop["storage_kwargs"] == {"overwrite": True} and loop["memory_budget"] == 100_000_000
    assert kwargs["evaluator_kwargs"]["memory_budget"] == 100_000_000  # the bess evaluator's device budget, too


def test_num_shards_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun --num-shards may name the world size (every rank one shard); another needs --replicas."""
    from pykeen_bess.cli import options

    monkeypatch.setattr(options, "_world_size", lambda: 2)
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--num-shards", "2"]), in_group=True)
    assert kwargs["training_loop_kwargs"]["num_shards"] == 2
    with pytest.raises(options.UsageError, match="--num-shards 1 under torchrun \\(2 processes\\) needs --replicas"):
        pipeline_kwargs(build_parser().parse_args(["train", "--num-shards", "1"]), in_group=True)
    kwargs = pipeline_kwargs(
        build_parser().parse_args(["train", "--num-shards", "1", "--replicas", "2"]), in_group=True
    )
    assert kwargs["training_loop_kwargs"]["replicas"] == 2


def test_early_stopping_is_reported(capsys: pytest.CaptureFixture) -> None:
    """Training that stops early says so at the default level (only --verbose showed PyKEEN's message)."""
    options = ["--dim", "8", "--epochs", "6", "--batch-size", "128", "--negatives", "8", "--quiet", "--json"]
    stopper = ["--early-stopping", "--stopper-frequency", "1", "--stopper-patience", "0"]
    code, out, err = run(capsys, *options, *stopper, "--lr", "0")  # nothing improves after the first validation
    assert code == 0, err
    stopped = re.search(r"pykeen-bess: stopped early after epoch (\d+) \(best: epoch 1\)", err)
    assert stopped is not None and int(stopped.group(1)) < 6, err
    json.loads(out)  # the metrics alone on stdout


def test_zero_epochs_say_the_model_is_untrained(capsys: pytest.CaptureFixture) -> None:
    """``--epochs 0`` evaluates the initial model (as PyKEEN does) and says so on stderr."""
    code, out, err = run(capsys, *FAST, "--epochs", "0")
    assert code == 0, err
    assert "no epoch was trained (--epochs 0)" in err and json.loads(out)
    code, out, err = run(capsys, *FAST)
    assert code == 0 and "no epoch was trained" not in err, err


def test_named_choices_are_matched_as_pykeen_matches_names() -> None:
    """``--evaluator BESS``, ``--storage Host`` or ``--checkpoint-retrieval one-per-group`` (the Python API accepts
    such spellings) were refused as invalid choices."""
    parser = build_parser()
    argv = ["train", "--evaluator", "BessEvaluator", "--exchange", "Auto", "--storage", "Host", "--corruption", "HT"]
    argv += [
        "--checkpoint-retrieval",
        "one-per-group",
        "--replica-grouping",
        "Orthogonal",
        "--checkpoint-format",
        "PBG",
    ]
    args = parser.parse_args(argv)
    assert (args.evaluator, args.exchange, args.storage, args.corruption) == ("bess", "auto", "host", "ht")
    assert (args.checkpoint_retrieval, args.replica_grouping, args.checkpoint_format) == (
        "one_per_group",
        "orthogonal",
        "pbg",
    )
    assert parser.parse_args(["train", "--evaluator", "rank_based"]).evaluator == "rankbased"
    assert parser.parse_args(["train", "--evaluator", "RankBasedEvaluator"]).evaluator == "rankbased"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--storage", "disk"])


@pytest.mark.parametrize("checkpoint_format", ["pbg", "PBG"])
def test_a_pbg_checkpoint_to_resume_is_found_whatever_the_formats_spelling(
    tmp_path: pathlib.Path, checkpoint_format: str
) -> None:
    """The loop accepts ``checkpoint_format="PBG"``; the command line compared the raw value, so a configuration
    spelling it so did not say it resumed an existing PyTorch-BigGraph checkpoint."""
    from pykeen_bess.cli import _checkpoint_to_resume

    (tmp_path / "checkpoint_version.txt").write_text("3")  # a committed PBG-layout checkpoint in the directory
    kwargs = dict(
        training_kwargs=dict(checkpoint_name="run.pt", checkpoint_directory=str(tmp_path)),
        training_loop_kwargs=dict(checkpoint_format=checkpoint_format),
    )
    assert _checkpoint_to_resume(kwargs) == tmp_path / "run.pt"


def test_first_hour_mistakes_are_usage_errors_before_any_work(
    capsys: pytest.CaptureFixture, tmp_path: pathlib.Path
) -> None:
    """A typo accepted as an abbreviation, a zero dimension, an unknown stopper metric (refused after the epochs
    before the first validation), a checkpoint name with a folder (refused after the first epoch), bad YAML (a
    parser's multi-line report), a negative import dimension: one-line usage errors, nothing trained."""
    for argv, message in (
        (["--epoch", "2"], "unrecognized arguments: --epoch 2"),
        (["--dim", "0"], "argument --dim: expected a positive integer, not 0"),
        (["--early-stopping", "--stopper-metric", "foo"], "--stopper-metric 'foo' is not one of the evaluation's"),
        (["--checkpoint-name", "sub/c.pt"], "a file name (the folder is --checkpoint-directory), not a path"),
    ):
        with pytest.raises(SystemExit) if argv[0] in ("--epoch", "--dim") else contextlib.nullcontext():
            code, out, err = run(capsys, "--dataset", "nations", "--quiet", *argv)
            assert code == 2 and out == "", err
        assert message in (err if argv[0] not in ("--epoch", "--dim") else capsys.readouterr().err)
    (tmp_path / "bad.yaml").write_text("a: [1\nb: 2\n")
    code, _, err = run(capsys, "--config", str(tmp_path / "bad.yaml"))
    assert code == 2 and "is not valid YAML (line 2)" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        main(["pbg", "import", "x.tsv", "--output", str(tmp_path / "o"), "--dim", "-4"])
    assert "argument --dim: expected a positive integer, not -4" in capsys.readouterr().err
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--early-stopping", "--stopper-metric", "hits@1"]))
    assert kwargs["stopper_kwargs"]["metric"] == "hits@1"
    code, _, err = run(capsys, "--dataset", "nations", "--checkpoint-name", "..")
    assert code == 2 and "a file name" in err
    # an evaluator configured with other metrics: a metric of theirs is taken
    config = tmp_path / "config.json"
    evaluator_kwargs = dict(metrics="hits@k", metrics_kwargs=dict(k=2))
    config.write_text(json.dumps(dict(dataset="nations", model="DistMult", evaluator_kwargs=evaluator_kwargs)))
    argv = ["train", "--config", str(config), "--early-stopping", "--stopper-metric", "hits@2"]
    assert pipeline_kwargs(build_parser().parse_args(argv))["stopper_kwargs"]["metric"] == "hits@2"


def test_a_configs_dataset_kwargs_and_progress_setting_are_kept(tmp_path: pathlib.Path) -> None:
    """A configuration's dataset_kwargs were dropped for a dataset directory (PyKEEN ignores them for a dataset
    object) and for --dataset, while metadata.json recorded them; its use_tqdm=False was overridden."""
    lines = ["a\tr\tb", "b\tr\tc", "c\ts\ta"]
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = tmp_path / "config.json"
    pipeline = dict(
        dataset=str(tmp_path), dataset_kwargs=dict(create_inverse_triples=True), model="DistMult",
        training_kwargs=dict(use_tqdm=False),
    )  # fmt: skip
    config.write_text(json.dumps(dict(pipeline=pipeline)))
    for extra in ([], ["--dataset", "nations"]):
        kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config), *extra]))
        assert kwargs["dataset"].training.create_inverse_triples, extra
        assert kwargs["dataset_kwargs"] == dict(create_inverse_triples=True)
        assert kwargs["training_kwargs"]["use_tqdm"] is False
    kwargs = pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config), "--quiet"]))
    assert kwargs["training_kwargs"]["use_tqdm"] is False and kwargs["evaluation_kwargs"]["use_tqdm"] is False
    config.write_text(json.dumps(dict(pipeline=dict(pipeline, dataset_kwargs=dict(no_such_option=1)))))
    with pytest.raises(ValueError, match="dataset_kwargs .* do not fit the dataset directory"):
        pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config)]))
    with pytest.raises(ValueError, match="dataset_kwargs .* do not fit the dataset 'nations'"):  # (not "unknown")
        pipeline_kwargs(build_parser().parse_args(["train", "--config", str(config), "--dataset", "nations"]))


def test_the_export_id_check_compares_what_the_graph_names(tmp_path: pathlib.Path) -> None:
    """A graph without entity names is compared by its relations only (its entity_labels() is None: a TypeError)."""
    import types

    from pykeen.datasets import Nations

    from pykeen_bess.cli.files import UsageError
    from pykeen_bess.cli.pbg import check_same_ids

    training = Nations().training
    training.to_path_binary(tmp_path / "training_triples")
    relations = [training.relation_id_to_label[i] for i in range(training.num_relations)]
    entities = [training.entity_id_to_label[i] for i in range(training.num_entities)]

    def graph(entity_labels, relation_names):
        schema = types.SimpleNamespace(relation_names=tuple(relation_names))
        return types.SimpleNamespace(entity_labels=lambda: entity_labels, schema=schema)

    check_same_ids(tmp_path / "training_triples", graph(None, relations))
    check_same_ids(tmp_path / "training_triples", graph(entities, relations))
    with pytest.raises(UsageError, match="entity ids are not the graph's"):
        check_same_ids(tmp_path / "training_triples", graph(entities[::-1], relations))
    with pytest.raises(UsageError, match="relation ids are not the graph's"):
        check_same_ids(tmp_path / "training_triples", graph(None, relations[::-1]))
    check_same_ids(tmp_path / "nothing", graph(None, relations))  # no saved mapping, no names: nothing to check
