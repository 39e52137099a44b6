"""The benchmark scripts run end to end on tiny inputs, with ``--device`` as a user passes it.

Each script runs as a user runs it (``python benchmarks/NAME.py ...``, a fresh interpreter) on
PyKEEN's bundled Nations or a small generated graph, and must print its table; the evaluation
benchmark must also find every evaluator's metrics equal to PyKEEN's. A CUDA ``--device`` that
torch cannot use is an error before any work starts (PyKEEN would fall back to the CPU, and the
table would report CPU figures under a GPU's name).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def nations_directory() -> str:
    """PyKEEN's bundled Nations (train.txt, valid.txt, test.txt)."""
    import pykeen.datasets.nations as nations

    return str(pathlib.Path(nations.__file__).parent)


def run_benchmark(name: str, *arguments: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/NAME.py`` with ``arguments`` from the repository root, as the README does."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table_rows(output: str) -> list[list[str]]:
    """The cells of the markdown table rows an output printed (header and separator lines excluded)."""
    rows = [line.strip().strip("|").split("|") for line in output.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows if not row[0].strip().startswith("-")][1:]


def successful_run(name: str, *arguments: str) -> tuple[str, list[list[str]]]:
    """Run a benchmark that must succeed; return its standard output and the rows of its table."""
    result = run_benchmark(name, *arguments)
    assert result.returncode == 0, result.stderr
    return result.stdout, table_rows(result.stdout)


def load_devices():
    """Import ``benchmarks/devices.py`` (the scripts import it from their own folder)."""
    spec = importlib.util.spec_from_file_location("benchmark_devices", BENCHMARKS / "devices.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_device():
    """``auto`` resolves to CUDA only where torch sees it; ``cpu`` is the CPU; other kinds are refused."""
    devices = load_devices()
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert devices.parse_device("auto") == expected
    assert devices.parse_device("cpu") == torch.device("cpu")
    for text in ("tpu", "mps", "nonsense"):
        with pytest.raises(argparse.ArgumentTypeError):
            devices.parse_device(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused():
    """Without CUDA, ``--device cuda`` fails in argument parsing (PyKEEN would silently use the CPU)."""
    devices = load_devices()
    for text in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device"):
            devices.parse_device(text)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("training", ["--data", "DATA", "--device", "cuda"]),
        ("evaluation", ["--data", "DATA", "--device", "cuda"]),
        ("scale", ["--device", "cuda"]),
        ("storage", ["--data", "DATA", "--device", "cuda"]),
        ("quality", ["--config", "configs/nations_rotate.json", "--data", "nations", "--device", "cuda"]),
        ("distributed", ["--data", "DATA", "--backend", "nccl"]),
    ],
)
def test_scripts_refuse_cuda_without_a_gpu(name: str, arguments: list[str]):
    """Every script that computes refuses a CUDA device it cannot use, with a usage error, before any work."""
    result = run_benchmark(name, *(nations_directory() if a == "DATA" else a for a in arguments), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "CUDA" in result.stderr or "GPU" in result.stderr


@pytest.mark.slow
def test_training_benchmark():
    """Stock loop, hand-written step and the three BESS settings on Nations and a generated graph."""
    output, rows = successful_run(
        "training",
        *("--data", nations_directory(), "--dim", "8", "--negatives", "4", "--batch-size", "32", "--epochs", "2"),
        *("--generated-entities", "200", "--generated-triples", "500", "--stock-batches", "2", "--repeats", "1"),
        *("--device", "cpu"),
    )
    assert [row[0] for row in rows] == ["nations"] * 6 + ["generated (200 entities)"] * 6
    assert all(float(row[2].replace(",", "")) > 0 for row in rows)
    assert "CPU" in output


@pytest.mark.slow
def test_pbg_workload_on_both_graphs(tmp_path: pathlib.Path):
    """PyTorch-BigGraph itself and the three BESS settings on the uniform and the skewed graph, written as JSON."""
    output = tmp_path / "pbg.json"
    _, rows = successful_run(
        "training",
        *("--pbg-workload", "--pbg-entities", "400", "--pbg-triples", "3000", "--pbg-skewed", "300:2000"),
        *("--pbg-dim", "4", "--epochs", "2", "--repeats", "1", "--device", "cpu", "--output", str(output)),
    )
    assert [row[0] for row in rows] == ["generated (400 entities)"] * 4 + ["skewed (300 entities, Zipf heads)"] * 4
    written = json.loads(output.read_text())
    assert written["benchmark"] == "training-pbg-workload" and written["date"] and written["machine"]
    rows = written["tables"][0]["rows"]
    assert [(row["num_shards"], row["negatives"]) for row in rows[:4]] == [
        (None, None),
        (1, "step"),
        (4, "step"),
        (4, "block"),
    ]
    assert all(row["positives_per_s"] > 0 for row in rows)


def test_structured_graph_has_its_patterns(tmp_path: pathlib.Path):
    """The generated graph for quality checks: its relations, symmetric knows, inverse parent_of / child_of."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from structured import structured_triples, write_splits
    finally:
        sys.path.remove(str(BENCHMARKS))
    triples = {tuple(row) for row in structured_triples(num_people=300, num_groups=30, num_items=100).tolist()}
    assert {r for _, r, _ in triples} == {
        "member_of", "located_in", "lives_in", "knows", "parent_of", "child_of", "likes"
    }  # fmt: skip
    assert all((t, r, h) in triples for h, r, t in triples if r == "knows")
    assert all((t, "child_of", h) in triples for h, r, t in triples if r == "parent_of")
    directory = write_splits(tmp_path, num_people=300, num_groups=30, num_items=100)
    splits = {name: (directory / f"{name}.txt").read_text().splitlines() for name in ("train", "valid", "test")}
    assert sum(map(len, splits.values())) == len(triples)
    seen = {part for line in splits["train"] for part in line.split("\t")[::2]}
    assert all(set(line.split("\t")[::2]) <= seen for line in splits["test"] + splits["valid"])


@pytest.mark.slow
def test_parity_benchmark(tmp_path: pathlib.Path):
    """Shard counts against one shard through the command line's settings; a second run skips what is written."""
    output = tmp_path / "parity.json"
    arguments = ("--data", "nations", "--variants", "quick=--epochs 1 --dim 8", "--num-shards", "1", "2")
    stdout, rows = successful_run("parity", *arguments, "--seeds", "0", "1", "--output", str(output))
    assert [(row[0], row[1], row[2], row[3]) for row in rows] == [
        ("nations", "quick", "1", "2"),
        ("nations", "quick", "2", "2"),
    ]
    written = json.loads(output.read_text())
    assert len(written["runs"]) == 4 and {run["num_shards"] for run in written["runs"]} == {1, 2}
    again = run_benchmark("parity", *arguments, "--seeds", "0", "1", "--output", str(output))
    assert again.returncode == 0 and '"mrr"' not in again.stdout  # nothing run again


@pytest.mark.slow
def test_evaluation_benchmark_metrics_equal_pykeen():
    """Both evaluators on both datasets; every BessEvaluator row's metrics equal PyKEEN's."""
    output, rows = successful_run(
        "evaluation",
        *("--data", nations_directory(), "--generated", "300:5:3000:50", "--dim", "8", "--train-epochs", "1"),
        *("--pykeen-batch-sizes", "64", "--bess-shards", "1,2", "--device", "cpu"),
    )
    rows = [row for row in table_rows(output) if row[1] != "matmul alone"]
    assert [(row[1], row[2]) for row in rows] == [
        ("PyKEEN RankBasedEvaluator", "batch_size=64"),
        ("BessEvaluator", "n=1"),
        ("BessEvaluator", "n=2"),
    ] * 2
    assert all(row[7].startswith("yes") for row in rows)


def test_evaluation_rows_from_another_script():
    """``evaluation_rows`` (imported as another script does) builds a generated graph and returns one row per run."""
    code = (
        "import json, sys, warnings; sys.path.insert(0, 'benchmarks'); warnings.filterwarnings('ignore')\n"
        "from evaluation import evaluation_rows\n"
        "rows = evaluation_rows('cpu', generated='300:5:3000:50', dim=8, train_epochs=1, repeats=1, log=None)\n"
        "keys = ('dataset', 'name', 'setting', 'seconds', 'speedup', 'percent_of_matmul', 'metrics_equal', "
        "'max_rel_diff', 'ranked_again')\n"
        "print(json.dumps([{key: row[key] for key in keys} for row in rows]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(row["name"], row["setting"]) for row in rows] == [
        ("PyKEEN RankBasedEvaluator", "batch_size=default"),
        ("BessEvaluator", "n=1"),
        ("BessEvaluator", "n=4"),
    ]
    assert {row["dataset"] for row in rows} == {"generated 300:5:3000:50"}
    for row in rows:
        assert row["seconds"] > 0 and row["speedup"] > 0 and row["percent_of_matmul"] > 0
        assert row["metrics_equal"] is True and row["max_rel_diff"] == 0.0  # identical to PyKEEN's
    assert set(rows[1]["ranked_again"]) == {"head", "tail"}


@pytest.mark.slow
def test_scale_benchmark():
    """Every stage of both shard counts on a small generated graph, with the setup summary."""
    output, rows = successful_run(
        "scale",
        *("--entities", "2000", "--relations", "10", "--triples", "20000", "--test", "50", "--dim", "8"),
        *("--negatives", "8", "--batch-size", "256", "--shards", "1,2", "--steps", "5", "--quiet", "--device", "cpu"),
    )
    stages = [(row[0], row[1].split(":")[0]) for row in table_rows(output)]
    expected = ["factory", "model", "loop", "train", "evaluation", "**setup before the first step (target < 60 s)**"]
    assert [stage for _, stage in stages] == [name.split(":")[0] for name in expected] * 2
    assert "5/" in output and "partial epoch" in output


@pytest.mark.slow
def test_quality_benchmark(tmp_path: pathlib.Path):
    """A small configuration with an early stopper through ``pipeline()``: stock PyKEEN, 1 and 2 shards, two seeds.

    Each run prints the validation curve, the best epoch, the test metrics and the seen-entity MRR;
    the last line gives each seed's MRR difference between the shard counts.
    """
    config = tmp_path / "tiny.json"
    config.write_text(
        json.dumps(
            {
                "pipeline": {
                    "model": "DistMult",
                    "model_kwargs": {"embedding_dim": 8},
                    "training_loop": "bess",
                    "training_kwargs": {"num_epochs": 3, "batch_size": 256},
                    "evaluator": "bess",
                    "stopper": "early",
                    "stopper_kwargs": {"frequency": 1, "patience": 5, "metric": "mrr"},
                    "random_seed": 0,
                }
            }
        )
    )
    output, rows = successful_run(
        "quality",
        "--config",
        str(config),
        "--data",
        "nations",
        "--num-shards",
        "1",
        "2",
        "--seeds",
        "3",
        "5",
        "--stock",
    )
    runs = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    order = [(3, None), (3, 1), (3, 2), (5, None), (5, 1), (5, 2)]
    assert [(run["seed"], run["num_shards"]) for run in runs] == order
    for run in runs:
        assert run["epochs"] == 3 and [epoch for epoch, _ in run["validation"]] == [1, 2, 3]
        assert run["best_epoch"] in (1, 2, 3)
        assert 0 < run["seen_mrr"] <= 1 and run["seen_triples"] == run["test_triples"] == 201
    assert runs[1]["mrr"] != runs[4]["mrr"]  # the seed reaches the pipeline
    assert runs[0]["mrr"] != runs[1]["mrr"]  # stock PyKEEN trains differently
    assert [(row[1], row[2]) for row in rows] == [
        ("stock PyKEEN (sLCWA)" if n is None else str(n), str(seed)) for seed, n in order
    ]
    assert all(row[4].startswith("3 (best ") and 0 < float(row[5].split()[0]) <= 1 for row in rows)
    bess = [run for run in runs if run["num_shards"] is not None]
    differences = [run["mrr"] - first["mrr"] for first, run in zip(bess[::2], bess[1::2])]
    expected = f"seed 3 {differences[0]:+.4f}, seed 5 {differences[1]:+.4f}; mean {sum(differences) / 2:+.4f}"
    assert f"# test MRR, n = 2 minus n = 1: {expected}, standard error " in output
    first = [run["mrr"] for run in bess[::2]]
    assert f"# test MRR, n = 1, 2 seeds: mean {sum(first) / 2:.4f}, standard deviation " in output


@pytest.mark.slow
def test_storage_benchmark():
    """The device and host tiers train and evaluate in worker processes on the chosen device."""
    output, rows = successful_run(
        "storage",
        *("--data", nations_directory(), "--tiers", "device", "host", "--optimizers", "adam", "--epochs", "2"),
        *("--dim", "8", "--negatives", "4", "--batch-size", "64", "--eval-triples", "20", "--threads", "1"),
        *("--device", "cpu"),
    )
    assert [(row[0], row[1]) for row in rows] == [("adam", "device"), ("adam", "host")]
    assert "compute device cpu" in output


@pytest.mark.slow
def test_distributed_benchmark():
    """One process, then two gloo ranks; the measured bytes per step equal the cost model's."""
    output, rows = successful_run(
        "distributed",
        *("--data", nations_directory(), "--layouts", "1x1", "2x1", "--exchanges", "embedding", "--dim", "8"),
        *("--negatives", "4", "--batch-size", "64"),
    )
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("nations", "1 x 1", "embedding"),
        ("nations", "2 x 1", "embedding"),
    ]
    assert [row[5] for row in rows] == [row[6] for row in rows]
    assert int(rows[1][5].replace(",", "")) > 0


@pytest.mark.slow
def test_storage_benchmark_large_removes_its_files(tmp_path: pathlib.Path):
    """``--large`` trains from files on the CPU (without ``--device``) and leaves no table files behind."""
    output, rows = successful_run(
        "storage",
        *("--large", "1000", "--large-steps", "25", "--batch-size", "64", "--dim", "8", "--negatives", "4"),
        *("--eval-triples", "10", "--threads", "1", "--storage-dir", str(tmp_path)),
    )
    assert "25 training steps" in output and "filtered evaluation of 10 triples" in output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_gpu_benchmark_runs_its_sections_on_the_cpu(tmp_path: pathlib.Path):
    """benchmarks/gpu.py on tiny sizes (the static step uncaptured): every section gives rows, the check passes."""
    output = tmp_path / "gpu.json"
    stdout, rows = successful_run(
        "gpu", "--device", "cpu", "--quick", "--sections", "check", "training", "profile", "--output", str(output)
    )
    sections = [row[0] for row in rows]
    assert {"check", "training", "profile"} <= set(sections), stdout
    assert all(row[5] == "yes" for row in rows if row[0] == "check"), stdout
    assert not any("failed" in row[3] for row in rows), stdout
    assert len(json.loads(output.read_text())["rows"]) == len(rows)
