"""The benchmark scripts run end to end on tiny inputs, with ``--device`` as a user passes it.

Each script runs as a user runs it (``python benchmarks/NAME.py ...``: its own ``sys.argv`` and
``__main__``, in a child forked from an interpreter that has imported PyKEEN) on PyKEEN's bundled
Nations or a small generated graph, and must print its table; the evaluation
benchmark must also find every evaluator's metrics equal to PyKEEN's. A CUDA ``--device`` that
torch cannot use is an error before any work starts (PyKEEN would fall back to the CPU, and the
table would report CPU figures under a GPU's name).

The runs write their result files (``--output``) into one folder under the names the docs'
benchmarks page reads; each test checks its file's header and the row keys the page's renderer
reads, and ``test_the_benchmarks_page_renders_the_scripts_result_files`` renders that folder with
``docs/render_benchmarks.py``. The runs are module-scoped fixtures, so each runs once however many
tests use it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
HEADER = ("benchmark", "script", "date", "commit", "machine", "device", "command", "configuration")


def nations_directory() -> str:
    """PyKEEN's bundled Nations (train.txt, valid.txt, test.txt)."""
    import pykeen.datasets.nations as nations

    return str(pathlib.Path(nations.__file__).parent)


def table_rows(output: str) -> list[list[str]]:
    """The cells of the markdown table rows an output printed (header and separator lines excluded)."""
    rows = [line.strip().strip("|").split("|") for line in output.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows if not row[0].strip().startswith("-")][1:]


def result_file(path: pathlib.Path, benchmark: str, keys: tuple[str, ...]) -> dict:
    """Read a result file a run wrote: the header of :mod:`result_files` and rows with ``keys``; return it."""
    data = json.loads(path.read_text())
    assert set(HEADER) <= set(data), sorted(data)
    assert data["benchmark"] == benchmark and data["date"] and data["machine"] and data["configuration"]
    assert data["command"].startswith(f"python {data['script']} ") and "--output" in data["command"]
    parts = data["tables"] if "tables" in data else [dict(title="", rows=data["rows"])]
    for part in parts:
        assert part["rows"], part["title"]
        for row in part["rows"]:
            assert set(keys) <= set(row), (part["title"], sorted(set(keys) - set(row)))
    return data


def load_module(name: str, directory: pathlib.Path = BENCHMARKS):
    """Import ``directory/NAME.py`` with its folder on the import path (the scripts import their neighbours)."""
    saved = list(sys.path)
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved  # also what a script added itself


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The folder of the runs' result files, named as ``benchmarks/results/`` names them."""
    return tmp_path_factory.mktemp("results")


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


def load_script(name: str):
    """Import ``benchmarks/NAME.py`` under a name of its own (tests/ has folders named like some scripts)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"benchmark_script_{name}", BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


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
def test_scripts_refuse_cuda_without_a_gpu(
    name: str, arguments: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    """Every script that computes refuses a CUDA device it cannot use, with a usage error, before any work."""
    script = load_script(name)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *(nations_directory() if a == "DATA" else a for a in arguments)])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    error = capsys.readouterr().err
    assert exit_info.value.code == 2, error
    assert "CUDA" in error or "GPU" in error


@pytest.fixture(scope="module")
def benchmark_runs(results: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The tiny runs of the scripts that the fixtures below hand to their tests, all started at once.

    Each script runs as ``python benchmarks/NAME.py ...`` from the repository root would (its own
    ``sys.argv``, ``__main__``, output), in a child forked from an interpreter that has imported PyKEEN
    and the plugin (:mod:`forked_programs`), two at a time; what a script starts itself (fresh
    processes, ranks, baseline checkouts) it starts as always. Asking for one fixture runs them all.
    """
    from forked_programs import run_chains

    config = tmp_path_factory.mktemp("quality") / "tiny.json"
    large, digests = tmp_path_factory.mktemp("large"), tmp_path_factory.mktemp("digests")
    (large / "tables").mkdir()
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
    # the longest first: two at a time, they end about together
    runs: dict[str, tuple[str, ...]] = dict(
        gpu=(
            "gpu",
            *("--device", "cpu", "--quick", "--sections", "check", "training", "profile", "configurations"),
            *("--output", str(results / "gpu-h200.json")),
        ),
        training=(
            "training",
            *("--data", nations_directory(), "--dim", "8", "--negatives", "4", "--batch-size", "32", "--epochs", "2"),
            *("--generated-entities", "200", "--generated-triples", "500", "--stock-batches", "2", "--repeats", "1"),
            *("--allocator-runs", "1", "--device", "cpu", "--output", str(results / "training-cpu.json")),
        ),
        pbg=(
            "training",
            *("--pbg-workload", "--pbg-entities", "400", "--pbg-triples", "3000", "--pbg-skewed", "300:2000"),
            *("--pbg-dim", "4", "--epochs", "2", "--ratio-epochs", "2", "--repeats", "1", "--device", "cpu"),
            *("--output", str(results / "training-pbg-workload-cpu.json")),
        ),
        distributed=(
            "distributed",
            *("--data", nations_directory(), "--layouts", "1x1", "2x1", "--exchanges", "embedding", "--dim", "8"),
            *("--negatives", "4", "--batch-size", "64", "--output", str(results / "distributed-cpu.json")),
        ),
        storage=(
            "storage",
            *("--data", nations_directory(), "--tiers", "device", "host", "--optimizers", "adam", "--epochs", "2"),
            *("--dim", "8", "--negatives", "4", "--batch-size", "64", "--eval-triples", "20", "--threads", "1"),
            *("--device", "cpu", "--output", str(results / "storage-cpu.json")),
        ),
        step_ab_distributed=(
            "distributed",
            *("--data", nations_directory(), "--layouts", "2x1", "--exchanges", "embedding", "--dim", "8"),
            *("--negatives", "4", "--batch-size", "64", "--baseline", str(ROOT), "--ab-runs", "1"),
            *("--output", str(results / "distributed-step-ab-cpu.json")),
        ),
        evaluation_ab=(
            "evaluation_ab",
            *("--baseline", str(ROOT), "--generated", "300:10:3000:100", "--shards", "1", "--pairs", "1"),
            *("--repeats", "1", "--output", str(results / "evaluation-ab-cpu.json")),
        ),
        step_ab_training=(
            "training",
            *("--data", nations_directory(), "--dim", "8", "--negatives", "4", "--batch-size", "32", "--epochs", "2"),
            *("--baseline", str(ROOT), "--ab-runs", "1", "--ab-shards", "1", "--threads", "1", "--device", "cpu"),
            *("--output", str(results / "training-step-ab-cpu.json")),
        ),
        quality=(
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
            "--output",
            str(results / "quality-cpu.json"),
        ),
        evaluation=(
            "evaluation",
            *("--data", nations_directory(), "--generated", "300:5:3000:50", "--dim", "8", "--train-epochs", "1"),
            *("--pykeen-batch-sizes", "64", "--bess-shards", "1,2", "--device", "cpu"),
            *("--output", str(results / "evaluation-cpu.json")),
        ),
        evaluation_models=(
            "evaluation_models",
            *("--run", "SE,NTN@120/12", "--pykeen-batch-sizes", "32", "--dim", "4"),
            *("--output", str(results / "evaluation-models-cpu.json")),
        ),
        scale=(
            "scale",
            *("--entities", "2000", "--relations", "10", "--triples", "20000", "--test", "50", "--dim", "8"),
            *(
                "--negatives",
                "8",
                "--batch-size",
                "256",
                "--shards",
                "1,2",
                "--steps",
                "5",
                "--quiet",
                "--device",
                "cpu",
            ),
            *("--output", str(results / "scale-cpu.json")),
        ),
        parity=("parity", *PARITY_ARGUMENTS, "--seeds", "0", "1", "--output", str(results / "parity-cpu.json")),
        storage_large=(
            "storage",
            *("--large", "1000", "--large-steps", "25", "--batch-size", "64", "--dim", "8", "--negatives", "4"),
            *("--eval-triples", "10", "--threads", "1", "--storage-dir", str(large / "tables")),
            *("--output", str(large / "large.json")),
        ),
        checkpoints=(
            "checkpoints",
            *("--entities", "3000", "--dim", "8", "--repeats", "1", "--tiers", "device", "mmap"),
            *("--directories", str(digests), "--output", str(digests / "checkpoints.json")),
        ),
    )
    chains = [[dict(script=str(BENCHMARKS / f"{name}.py"), argv=list(arguments), cwd=str(ROOT))]
              for name, *arguments in runs.values()]  # fmt: skip
    chains[list(runs).index("parity")].append(chains[list(runs).index("parity")][0])  # again: nothing to run
    chains.append([dict(code=EVALUATION_ROWS, cwd=str(ROOT))])
    outcomes = {}
    for key, (outcome, *again) in zip([*runs, "evaluation_rows"], run_chains(chains, preload="plugin")):
        outcomes[key] = outcome
        if again:
            outcomes[f"{key}_again"] = again[0]
    outcomes["storage_large"]["folder"], outcomes["checkpoints"]["folder"] = large, digests
    print("benchmark runs (s):", {key: round(outcome["seconds"], 1) for key, outcome in outcomes.items()})
    return outcomes


def finished(runs: dict[str, dict], key: str) -> tuple[str, list[list[str]]]:
    """A run of :func:`benchmark_runs` that must have succeeded: its standard output and the rows of its table."""
    run = runs[key]
    assert run["status"] == 0, run["stderr"][-5000:]
    return run["stdout"], table_rows(run["stdout"])


@pytest.fixture(scope="module")
def training_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "training")


@pytest.mark.slow
def test_training_benchmark(training_run, results: pathlib.Path):
    """Stock loop, hand-written step and the three BESS settings on Nations and a generated graph.

    On the first graph also BESS n = 1 and n = 4 in fresh processes, with and without the allocator setting.
    """
    output, rows = training_run
    assert [row[0] for row in rows] == ["nations"] * 10 + ["generated"] * 6  # the table prints the short name
    assert all(float(row[2].replace(",", "")) > 0 for row in rows)
    assert "CPU" in output
    keys = ("dataset", "loop", "num_shards", "negatives", "positives_per_s")
    written = result_file(results / "training-cpu.json", "training", keys)
    datasets = [row["dataset"].split(" (")[0] for row in written["tables"][0]["rows"]]
    assert datasets == ["nations"] * 10 + ["generated"] * 6 and written["device"].startswith("CPU")
    ratios = ("x_stock", "x_handwritten", "n1_over_this", "first_epoch_positives_per_s")
    bess = [row for row in written["tables"][0]["rows"] if row["loop"] == "BessTrainingLoop"]
    assert len(bess) == 6 and all(set(ratios) <= set(row) for row in bess)
    fresh = [row for row in written["tables"][0]["rows"] if "fresh process" in row["loop"]]
    assert sorted((row["loop"].split("host_allocator=")[1], row["num_shards"]) for row in fresh) == [
        ("'auto'", 1),
        ("'auto'", 4),
        ("None", 1),
        ("None", 4),
    ]
    assert all(row["positives_per_s"] > 0 and set(ratios) <= set(row) for row in fresh)


@pytest.fixture(scope="module")
def pbg_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "pbg")


@pytest.mark.slow
def test_pbg_workload_on_both_graphs(pbg_run, results: pathlib.Path):
    """PyTorch-BigGraph itself, the three BESS settings and two regularized ones on both graphs, written as JSON."""
    _, rows = pbg_run
    assert [row[0] for row in rows] == ["generated (400 entities)"] * 6 + ["skewed (300 entities, Zipf heads)"] * 6
    keys = ("run", "contender", "num_shards", "negatives", "positives_per_s", "x_pbg")
    written = result_file(results / "training-pbg-workload-cpu.json", "training-pbg-workload", keys)
    rows = written["tables"][0]["rows"]
    assert [(row["num_shards"], row["negatives"], "x_unregularized" in row) for row in rows[:6]] == [
        (None, None, False),
        (1, "step", False),
        (4, "step", False),
        (4, "block", False),
        (1, "step", True),
        (4, "step", True),
    ]
    assert all(row["positives_per_s"] > 0 for row in rows)
    assert all(row["x_unregularized"] > 0 for row in rows if "x_unregularized" in row)


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


PARITY_ARGUMENTS = ("--data", "nations", "--variants", "quick=--epochs 1 --dim 8", "--num-shards", "1", "2")


@pytest.fixture(scope="module")
def parity_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "parity")


@pytest.mark.slow
def test_parity_benchmark(parity_run, benchmark_runs: dict[str, dict], results: pathlib.Path):
    """Shard counts against one shard through the command line's settings; a second run skips what is written."""
    output = results / "parity-cpu.json"
    stdout, rows = parity_run
    assert [(row[0], row[1], row[2], row[3]) for row in rows] == [
        ("nations", "quick", "1", "2"),
        ("nations", "quick", "2", "2"),
    ]
    written = json.loads(output.read_text())
    assert len(written["runs"]) == 4 and {run["num_shards"] for run in written["runs"]} == {1, 2}
    again, _ = finished(benchmark_runs, "parity_again")  # the same command, run after it
    assert '"mrr"' not in again  # nothing run again


@pytest.fixture(scope="module")
def evaluation_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "evaluation")


@pytest.mark.slow
def test_evaluation_benchmark_metrics_equal_pykeen(evaluation_run, results: pathlib.Path):
    """Both evaluators on both datasets; every BessEvaluator row's metrics equal PyKEEN's."""
    output, rows = evaluation_run
    rows = [row for row in table_rows(output) if row[1] not in ("matmul alone", "one product")]
    assert [(row[1], row[2]) for row in rows] == [
        ("PyKEEN RankBasedEvaluator", "batch_size=64"),
        ("BessEvaluator", "n=1"),
        ("BessEvaluator", "n=2"),
    ] * 2
    assert all(row[7].startswith("yes") for row in rows)
    keys = ("dataset", "name", "setting", "seconds", "peak_bytes", "metrics_equal", "bit_identical", "speedup")
    written = result_file(results / "evaluation-cpu.json", "evaluation", (*keys, "rate", "percent_of_matmul"))
    assert [(row["name"], row["setting"]) for row in written["rows"]] == [(row[1], row[2]) for row in rows]
    assert all(row["metrics_equal"] is True and len(row["metrics"]) == 225 for row in written["rows"])
    assert all(row["x_one_product"] > 0 and row["first_seconds"] > 0 for row in written["rows"])
    assert sum(row[1] == "one product" for row in table_rows(output)) == 2


@pytest.fixture(scope="module")
def evaluation_models_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "evaluation_models")


@pytest.mark.slow
def test_evaluation_of_models_without_a_fast_scorer(evaluation_models_run, results: pathlib.Path):
    """PyKEEN's evaluator and BessEvaluator on each model; the metrics equal, the rows written."""
    output, rows = evaluation_models_run
    expected = [(model, evaluator) for model in ("SE", "NTN") for evaluator in (
        "PyKEEN RankBasedEvaluator, batch_size=32", "BessEvaluator")]  # fmt: skip
    assert [(row[1], row[2]) for row in rows] == expected
    assert all(row[5] == "yes" for row in rows)
    keys = ("graph", "model", "evaluator", "seconds", "peak_mib", "metrics_equal_to_pykeen", "x_pykeen")
    written = result_file(results / "evaluation-models-cpu.json", "evaluation-models", keys)
    assert [(row["model"], row["evaluator"]) for row in written["rows"]] == expected
    assert all(row["metrics_equal_to_pykeen"] is True and row["seconds"] > 0 for row in written["rows"])


#: ``evaluation_rows`` imported as another script does (a run of :func:`benchmark_runs`)
EVALUATION_ROWS = (
    "import json, sys, warnings; sys.path.insert(0, 'benchmarks'); warnings.filterwarnings('ignore')\n"
    "from evaluation import evaluation_rows\n"
    "rows = evaluation_rows('cpu', generated='300:5:3000:50', dim=8, train_epochs=1, repeats=1, log=None)\n"
    "keys = ('dataset', 'name', 'setting', 'seconds', 'speedup', 'percent_of_matmul', 'metrics_equal', "
    "'max_rel_diff', 'ranked_again')\n"
    "print(json.dumps([{key: row[key] for key in keys} for row in rows]))\n"
)


@pytest.mark.slow
def test_evaluation_rows_from_another_script(benchmark_runs: dict[str, dict]):
    """``evaluation_rows`` (imported as another script does) builds a generated graph and returns one row per run."""
    stdout, _ = finished(benchmark_runs, "evaluation_rows")
    rows = json.loads(stdout.strip().splitlines()[-1])
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


@pytest.fixture(scope="module")
def scale_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "scale")


@pytest.mark.slow
def test_scale_benchmark(scale_run, results: pathlib.Path):
    """Every stage of both shard counts on a small generated graph, with the setup summary."""
    output, rows = scale_run
    stages = [(row[0], row[1].split(":")[0]) for row in table_rows(output)]
    expected = ["factory", "model", "loop", "train", "evaluation", "**setup before the first step (target < 60 s)**"]
    assert [stage for _, stage in stages] == [name.split(":")[0] for name in expected] * 2
    assert "5/" in output and "partial epoch" in output
    keys = ("num_shards", "stage", "seconds", "peak_rss_gib", "increase_gib", "notes")
    written = result_file(results / "scale-cpu.json", "scale", keys)["tables"][0]["rows"]
    assert [(row["num_shards"], row["stage"].split(":")[0]) for row in written] == [
        (n, stage.split(":")[0])
        for n in (1, 2)
        for stage in ["factory", "model", "loop", "train", "evaluation"] + ["setup before the first step"]
    ]
    assert written[-1]["peak_rss_gib"] is None and "partial epoch" in written[-1]["notes"]


@pytest.fixture(scope="module")
def quality_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "quality")


@pytest.mark.slow
def test_quality_benchmark(quality_run, results: pathlib.Path):
    """A small configuration with an early stopper through ``pipeline()``: stock PyKEEN, 1 and 2 shards, two seeds.

    Each run prints the validation curve, the best epoch, the test metrics and the seen-entity MRR;
    the last line gives each seed's MRR difference between the shard counts. The result file has a
    row per run and a mean row per shard count.
    """
    output, rows = quality_run
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
    keys = ("config", "dataset", "contender", "num_shards", "seeds", "minutes", "mrr", "hits_at_1", "hits_at_10")
    written = result_file(results / "quality-cpu.json", "quality", (*keys, "mrr_seen_entities", "test_triples"))
    (table,) = written["tables"]
    assert [(row["seeds"], row["num_shards"]) for row in table["rows"]] == [
        *((str(seed), n) for seed, n in order),
        *(("3, 5 (mean)", n) for n in (None, 1, 2)),
    ]
    assert table["rows"][-2]["mrr"] == pytest.approx(sum(first) / 2)
    assert [row["mrr"] for row in table["rows"][:6]] == [run["mrr"] for run in runs]
    assert "n = 2 minus n = 1" in table["summary"]


@pytest.fixture(scope="module")
def storage_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "storage")


@pytest.mark.slow
def test_storage_benchmark(storage_run, results: pathlib.Path):
    """The device and host tiers train and evaluate in worker processes on the chosen device."""
    output, rows = storage_run
    assert [(row[0], row[1]) for row in rows] == [("adam", "device"), ("adam", "host")]
    assert "compute device cpu" in output
    keys = ("optimizer", "storage", "triples_per_s", "vs_device", "mib_moved_per_step", "peak_rss_mib")
    written = result_file(results / "storage-cpu.json", "storage", (*keys, "eval_20_seconds", "mrr_20"))
    assert [(row["optimizer"], row["storage"]) for row in written["tables"][0]["rows"]] == [
        ("Adam", "device"),
        ("Adam", "host"),
    ]


@pytest.fixture(scope="module")
def distributed_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "distributed")


@pytest.mark.slow
def test_distributed_benchmark(distributed_run, results: pathlib.Path):
    """One process, then two gloo ranks; the measured bytes per step equal the cost model's."""
    output, rows = distributed_run
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("nations", "1 x 1", "embedding"),
        ("nations", "2 x 1", "embedding"),
    ]
    keys = ("graph", "layout", "exchange", "steps", "triples_per_s", "bytes_per_step", "bytes_cost_model")
    written = result_file(
        results / "distributed-cpu.json",
        "distributed",
        (*keys, "replica_bytes_per_step", "replica_cost_model_at_most", "peak_rss_mib"),
    )
    assert [
        [
            row["graph"],
            row["layout"],
            row["exchange"],
            f"{row['bytes_per_step']:,.0f}",
            f"{row['bytes_cost_model']:,.0f}",
        ]
        for row in written["tables"][0]["rows"]
    ] == [row[:3] + row[5:7] for row in rows]
    assert [row[5] for row in rows] == [row[6] for row in rows]
    assert int(rows[1][5].replace(",", "")) > 0


@pytest.mark.slow
def test_storage_benchmark_large_removes_its_files(benchmark_runs: dict[str, dict]):
    """``--large`` trains from files on the CPU (without ``--device``) and leaves no table files behind."""
    output, _ = finished(benchmark_runs, "storage_large")
    folder = benchmark_runs["storage_large"]["folder"]
    assert "25 training steps" in output and "filtered evaluation of 10 triples" in output
    assert list((folder / "tables").iterdir()) == []
    written = result_file(folder / "large.json", "storage", ("stage", "seconds", "what"))
    (table,) = written["tables"]
    assert table["command"] == written["command"] and "1,000 entities" in table["title"]
    assert [row["stage"] for row in table["rows"]][-3] == "25 training steps"


@pytest.fixture(scope="module")
def gpu_run(benchmark_runs: dict[str, dict]) -> tuple[str, list[list[str]]]:
    return finished(benchmark_runs, "gpu")


@pytest.mark.slow
def test_gpu_benchmark_runs_its_sections_on_the_cpu(gpu_run, results: pathlib.Path):
    """benchmarks/gpu.py on tiny sizes (the static step uncaptured): every section gives rows, the check passes."""
    output = results / "gpu-h200.json"
    stdout, rows = gpu_run
    sections = [row[0] for row in rows]
    assert {"check", "training", "profile", "configurations"} <= set(sections), stdout
    assert all(row[5] == "yes" for row in rows if row[0] == "check"), stdout
    assert not any("failed" in row[3] for row in rows), stdout
    assert len(json.loads(output.read_text())["rows"]) == len(rows)


def test_busy_cpu_and_pbg_import_rows(tmp_path: pathlib.Path):
    """busy_cpu.py's and pbg_import.py's rows (from given measurements: they have no tiny run) have the page's keys."""
    result_files = load_module("result_files")
    busy_cpu, pbg_import = load_module("busy_cpu"), load_module("pbg_import")
    settings = {
        "BESS training n=1": ["2 threads", "1 thread", "auto (default)"],
        "PyKEEN sLCWA (stock)": ["torch default (2)"],
    }
    measured = {(name, setting, busy): 100.0 - 50 * busy + index for name, cells in settings.items()
                for index, setting in enumerate(cells) for busy in (False, True)}  # fmt: skip
    rows = busy_cpu.result_rows(settings, measured)
    assert [(row["work"], row["threads"]) for row in rows] == [
        ("BESS training n=1", "2"),
        ("BESS training n=1", "1"),
        ("BESS training n=1", "auto (default)"),
        ("PyKEEN sLCWA (stock)", "torch default (2)"),
    ]
    assert rows[0]["slowdown_vs_best_idle"] == 102 / 50 and rows[3]["busy_neighbour"] == 50
    transcribed = json.loads((BENCHMARKS / "results" / "busy-cpu.json").read_text())["tables"][0]["rows"]
    assert all(list(row) == list(transcribed[0]) for row in rows)
    measured = {"base": 2**30, "peak": 2**31, "triples": 1000}
    imports = [("import_tsv", dict(measured, seconds=2.0)), ("pykeen", dict(measured, seconds=10.0))]
    labels = {"import_tsv": "pbg.import_tsv (label TSV)", "pykeen": "PyKEEN TriplesFactory.from_path (label TSV)"}
    rows = pbg_import.result_rows(imports, labels)
    assert [row["speedup_vs_pykeen"] for row in rows] == [5.0, 1.0] and rows[0]["above_imports_gib"] == 1.0
    transcribed = json.loads((BENCHMARKS / "results" / "pbg-import-cpu.json").read_text())["tables"][0]["rows"]
    assert all(list(row) == list(transcribed[0]) for row in rows)
    assert pbg_import.result_rows(imports[:1], labels)[0]["speedup_vs_pykeen"] is None
    written = result_files.write_result(tmp_path / "x.json", "PBG import", "benchmarks/pbg_import.py", [], "c")
    assert written["rows"] == [] and set(HEADER) <= set(written)


@pytest.fixture(scope="module")
def step_ab_runs(benchmark_runs: dict[str, dict]) -> tuple[str, str]:
    """This checkout's training step against a baseline checkout's (this one again), in one process and on ranks."""
    return finished(benchmark_runs, "step_ab_training")[0], finished(benchmark_runs, "step_ab_distributed")[0]


@pytest.mark.slow
def test_a_step_against_a_baseline_checkout(step_ab_runs, results: pathlib.Path):
    """``--baseline``: fresh processes (ranks) of either checkout, alternately; the medians and the pairs' ratios."""
    training, _ = step_ab_runs
    assert "# nations" not in training and "baseline" in training and "ratio" in training
    keys = ("num_shards", "baseline_positives_per_s", "this_positives_per_s", "ratio_median", "pairs")
    written = result_file(results / "training-step-ab-cpu.json", "training-step-ab", keys)
    (row,) = written["tables"][0]["rows"]
    assert row["num_shards"] == 1 and row["pairs"] == 1 and row["this_positives_per_s"] > 0
    assert row["ratio_median"] == pytest.approx(row["this_positives_per_s"] / row["baseline_positives_per_s"], 1e-2)
    keys = ("layout", "exchange", "baseline_triples_per_s", "this_triples_per_s", "ratio_median", "pairs")
    written = result_file(results / "distributed-step-ab-cpu.json", "distributed-step-ab", keys)
    (row,) = written["tables"][0]["rows"]
    assert (row["layout"], row["exchange"], row["pairs"]) == ("2 x 1", "embedding", 1) and row["this_triples_per_s"] > 0


@pytest.fixture(scope="module")
def evaluation_ab_run(benchmark_runs: dict[str, dict]) -> str:
    return finished(benchmark_runs, "evaluation_ab")[0]


@pytest.mark.slow
def test_the_evaluator_against_a_baseline_checkout(evaluation_ab_run: str, results: pathlib.Path):
    """evaluation_ab.py: a child of either checkout (this one twice) per pair; both evaluate the same model alike."""
    assert "pair 1" in evaluation_ab_run and "ratio" in evaluation_ab_run
    keys = ("dataset", "num_shards", "baseline_seconds", "this_seconds", "ratio_median", "pairs", "identical_mrr")
    written = result_file(results / "evaluation-ab-cpu.json", "evaluation-ab", keys)
    (row,) = written["rows"]
    assert row["num_shards"] == 1 and row["pairs"] == 1 and row["this_seconds"] > 0
    assert row["identical_mrr"] and row["baseline_mrr"] == row["this_mrr"]  # the same evaluator and model


@pytest.mark.slow
def test_checkpoint_digests_benchmark(benchmark_runs: dict[str, dict]):
    """checkpoints.py writes each tier's checkpoint with and without digests; its rows have the committed keys."""
    finished(benchmark_runs, "checkpoints")
    folder = benchmark_runs["checkpoints"]["folder"]
    output = folder / "checkpoints.json"
    rows = json.loads(output.read_text())["rows"]
    assert [row["storage"] for row in rows] == ["device", "mmap"]
    assert all(row["write with digests s"] > 0 and row["write without s"] > 0 and row["verify s"] > 0 for row in rows)
    committed = json.loads((BENCHMARKS / "results" / "checkpoints-cpu.json").read_text())["rows"]
    assert list(rows[0]) == list(committed[0])
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints.json"]  # its files are removed


@pytest.mark.slow
def test_the_benchmarks_page_renders_the_scripts_result_files(
    results: pathlib.Path,
    tmp_path: pathlib.Path,
    step_ab_runs,
    training_run,
    pbg_run,
    parity_run,
    evaluation_run,
    evaluation_models_run,
    evaluation_ab_run,
    scale_run,
    quality_run,
    storage_run,
    distributed_run,
    gpu_run,
):
    """``docs/render_benchmarks.py`` renders every file the tiny runs wrote: a script/renderer mismatch fails here."""
    render_benchmarks = load_module("render_benchmarks", ROOT / "docs")
    render_benchmarks.render(results, tmp_path / "out")
    rendered = set()
    for name, (filename, _, _) in render_benchmarks.RENDERERS.items():
        text = (tmp_path / "out" / f"{name}.md").read_text()
        if (results / filename).exists() and "|---|" in text:
            assert "No result file" not in text, name
            rendered.add(name)
    # no tiny run: the GPU file's scale, storage and evaluation sections (the tiny run skips them: the page
    # says so; evaluation.py's own tiny run runs the evaluation rows' code), measured-only benchmarks, and
    # tables of several --baseline runs in one file
    unrun = {
        "gpu-scale-storage",
        "gpu-evaluation",
        "busy",
        "pbg-import",
        "distributed-configurations-ab",
        "checkpoints",
    }
    assert rendered == set(render_benchmarks.RENDERERS) - unrun
    assert "measured no scale or storage rows" in (tmp_path / "out" / "gpu-scale-storage.md").read_text()
    assert "measured no evaluation rows" in (tmp_path / "out" / "gpu-evaluation.md").read_text()
    plots = ("training", "training-pbg", "parity", "scale", "evaluation", "distributed", "gpu-h200")
    assert all((tmp_path / "out" / f"{plot}.png").exists() for plot in plots)
