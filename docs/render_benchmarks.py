"""Render the benchmarks' result files (``benchmarks/results/*.json``) as Markdown tables and plots.

``conf.py`` calls :func:`render` at every docs build; it writes one Markdown snippet per benchmark
and its plots into ``docs/_generated/`` (git-ignored), which ``benchmarks.md`` includes. A result
file that does not exist gives a note on the page instead of a table. It also draws the
explanation's figure of the ``n x n`` shardpair blocks (``bess-blocks.svg``).

Run it alone with ``python docs/render_benchmarks.py`` to look at the output.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, MaxNLocator

Row = dict[str, Any]


def fmt(value: Any) -> str:
    """One table cell."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        if value == int(value) and abs(value) >= 1000:
            return f"{int(value):,}"
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def table(rows: Sequence[Row], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` with ``columns`` = (key, heading) pairs."""
    lines = ["| " + " | ".join(heading for _, heading in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def provenance(data: dict[str, Any], name: str) -> str:
    parts = [f"*Result file* `benchmarks/results/{name}`"]
    for key, label in (("date", "date"), ("machine", "machine"), ("device", "device"), ("commit", "commit")):
        if data.get(key):
            parts.append(f"*{label}* {data[key]}")
    text = "; ".join(parts) + ".\n"
    if data.get("command"):
        text += f"\nCommand: `{shown_command(data['command'])}`\n"
    if data.get("configuration"):
        text += f"\nConfiguration: {data['configuration']}\n"
    if data.get("source"):
        text += "\nRecorded before the benchmark wrote result files (no commit was recorded).\n"
    return text


def shown_command(command: str) -> str:
    """A recorded command as a reader runs it: their data directory, baseline checkout and output file."""
    command = re.sub(r"(?:\.\./)+shared/data/", "DATA/", command)
    command = re.sub(r"--baseline \S+", "--baseline BASELINE_CHECKOUT", command)
    return re.sub(r"--output \S+", "--output FILE.json", command)


def missing(name: str, script: str) -> str:
    command = script.replace("FILE", f"benchmarks/results/{name}")
    return (
        f"```{{note}}\nNo result file `benchmarks/results/{name}` in this build: run `{command}` to produce it.\n```\n"
    )


def save(figure: Any, out: Path, name: str) -> str:
    figure.tight_layout()
    figure.savefig(out / name)
    plt.close(figure)
    return f"\n![{name}](_generated/{name})\n"


def bars(
    ax: Any, labels: Sequence[str], values: Sequence[float], colors: Sequence[str] | None = None, log: bool = False
) -> None:
    positions = range(len(values))
    ax.barh(list(positions), values, color=colors)
    ax.set_yticks(list(positions), labels)
    ax.invert_yaxis()
    for position, value in zip(positions, values):
        ax.annotate(f" {value:,.0f}", (value, position), va="center", fontsize=8)
    if log:  # room for the value labels inside the frame
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 1.5, max(values) * 6)
    else:
        ax.set_xlim(0, max(values, default=1) * 1.25)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
    ax.xaxis.set_major_formatter(FuncFormatter(compact))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))


def compact(value: float, _: Any = None) -> str:
    """An axis tick in few characters (``1.5M``, ``250k``), so that ticks do not overlap."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}"


# --- one renderer per benchmark: (result file, script that writes it, renderer) ---------------------


def training(data: dict[str, Any], out: Path) -> str:
    rows = data["tables"][0]["rows"]
    columns = [
        ("dataset", "dataset"),
        ("loop", "loop"),
        ("num_shards", "n"),
        ("negatives", "negatives"),
        ("positives_per_s", "positives/s (steady)"),
        ("x_stock", "x stock"),
        ("x_handwritten", "x hand-written"),
        ("n1_over_this", "n=1 / this"),
        ("first_epoch_positives_per_s", "first epoch, positives/s"),
    ]
    text = table(rows, columns)
    datasets = list(dict.fromkeys(row["dataset"] for row in rows))
    figure, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 2.8), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        mine = [row for row in rows if row["dataset"] == dataset]
        labels = [
            row["loop"]
            .replace("PyKEEN SLCWATrainingLoop", "PyKEEN stock")
            .replace("BessTrainingLoop", "BESS")
            .replace(", BESS's allocator setting", ", BESS allocator")
            .replace(", C library's allocator", ", glibc default")
            + (f", n={row['num_shards']} {row['negatives']}" if row["loop"].startswith("BessTrainingLoop") else "")
            for row in mine
        ]
        colors = [
            "tab:gray" if "PyKEEN" in row["loop"] else "tab:orange" if "hand" in row["loop"] else "tab:blue"
            for row in mine
        ]
        bars(ax, labels, [row["positives_per_s"] for row in mine], colors, log=True)
        ax.set_xlabel("positives per second (log scale)")
        ax.set_title(dataset.split(" (")[0], fontsize=10)
    return text + save(figure, out, "training.png")


def training_pbg(data: dict[str, Any], out: Path) -> str:
    rows = data["tables"][0]["rows"]
    columns = [
        ("run", "run"),
        ("contender", "contender"),
        ("num_shards", "n"),
        ("negatives", "negatives"),
        ("positives_per_s", "positives/s (best epoch)"),
        ("x_pbg", "x PyTorch-BigGraph"),
        ("n1_over_this", "n=1 / this"),
        ("x_unregularized", "x unregularized"),
    ]
    text = table(rows, columns)
    runs = list(dict.fromkeys(row["run"] for row in rows))
    figure, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 2.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        mine = [row for row in rows if row["run"] == run]
        labels = [
            "PyTorch-BigGraph"
            if row["num_shards"] is None
            else f"BESS n={row['num_shards']}, {row['negatives']}"
            + (", regularized" if "x_unregularized" in row else "")
            for row in mine
        ]
        colors = ["tab:gray" if row["num_shards"] is None else "tab:blue" for row in mine]
        bars(ax, labels, [row["positives_per_s"] for row in mine], colors)
        ax.set_xlabel("positives per second")
        ax.set_title(f"PyTorch-BigGraph's workload ({run})", fontsize=10)
    return text + save(figure, out, "training-pbg.png")


def quality(data: dict[str, Any], out: Path) -> str:
    text = ""
    columns = [
        ("contender", "loop"),
        ("num_shards", "n"),
        ("seeds", "seeds"),
        ("minutes", "minutes"),
        ("mrr", "test MRR"),
        ("mrr_sd", "MRR sd"),
        ("hits_at_1", "Hits@1"),
        ("hits_at_10", "Hits@10"),
        ("mrr_seen_entities", "test MRR, entities seen in training"),
        ("test_triples", "test triples"),
    ]
    for part in data["tables"]:
        rows = [dict(row, contender=row.get("contender", "BESS")) for row in part["rows"]]
        used = [(key, heading) for key, heading in columns if any(row.get(key) is not None for row in rows)]
        text += f"\n**{part['title']}**\n\n" + table(rows, used)
        for key in ("published", "summary"):
            if part.get(key):
                text += f"\n{key.capitalize()}: {part[key]}.\n"
    return text


def scale(data: dict[str, Any], out: Path) -> str:
    rows = data["tables"][0]["rows"]
    columns = [
        ("num_shards", "n"),
        ("stage", "stage"),
        ("seconds", "wall time (s)"),
        ("peak_rss_gib", "peak RSS (GiB)"),
        ("increase_gib", "increase (GiB)"),
        ("peak_cuda_gib", "peak CUDA (GiB)"),
        ("notes", "notes"),
    ]
    text = table(rows, [(key, heading) for key, heading in columns if key != "peak_cuda_gib" or key in rows[0]])
    first = min(row["num_shards"] for row in rows)
    stages = [row["stage"] for row in rows if row["num_shards"] == first and row["peak_rss_gib"] is not None]
    figure, ax = plt.subplots(figsize=(7, 2.4))
    for offset, n in enumerate(sorted({row["num_shards"] for row in rows})):
        values = [next(r["seconds"] for r in rows if r["num_shards"] == n and r["stage"] == stage) for stage in stages]
        ax.barh([i + 0.4 * offset for i in range(len(stages))], values, height=0.4, label=f"n = {n}")
    ax.set_yticks([i + 0.2 for i in range(len(stages))], stages)
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s)")
    ax.legend(fontsize=8)
    ax.set_title("wikikg2-size graph: stages", fontsize=10)
    return text + save(figure, out, "scale.png")


def evaluation(data: Any, out: Path) -> str:
    rows = data if isinstance(data, list) else data["rows"]
    for row in rows:
        row["peak_mib"] = row["peak_bytes"] / 2**20 if row.get("peak_bytes") else None
        keys = len(row.get("metrics") or {}) or 225
        row["equal"] = f"{row['bit_identical']}/{keys} bit-identical" if row.get("metrics_equal") else "no"
        row["gflops"] = row["rate"] / 1e9 if row.get("rate") else None
    columns = [
        ("dataset", "dataset"),
        ("name", "evaluator"),
        ("setting", "setting"),
        ("seconds", "wall time (s)"),
        ("peak_mib", "peak memory (MiB)"),
        ("equal", "metrics equal to PyKEEN"),
        ("speedup", "speed-up vs PyKEEN best"),
        ("gflops", "effective GFLOP/s"),
        ("percent_of_matmul", "% of matmul rate"),
        ("x_one_product", "x one product"),
        ("first_seconds", "first evaluation (s)"),
    ]
    text = table(rows, columns)
    datasets = list(dict.fromkeys(row["dataset"] for row in rows))
    figure, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 2.2), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        mine = [row for row in rows if row["dataset"] == dataset]
        labels = [f"{row['name'].replace('RankBasedEvaluator', '')}{row['setting']}" for row in mine]
        colors = ["tab:gray" if "PyKEEN" in row["name"] else "tab:blue" for row in mine]
        bars(ax, labels, [row["speedup"] or 0 for row in mine], colors)
        ax.set_xlabel("speed-up against PyKEEN's best setting")
        ax.set_title(dataset, fontsize=10)
    return text + save(figure, out, "evaluation.png")


def gpu(data: dict[str, Any], out: Path, name: str, sections: Sequence[str]) -> str:
    rows = [row for row in data["rows"] if row["section"] in sections]
    if not rows:
        return f"The run on {data['device']} measured no {' or '.join(sections)} rows.\n"
    text = f"Device: **{data['device']}**.\n\n" + table(
        rows, [("section", "part"), ("workload", "workload"), ("contender", "contender"), ("figure", "figure")]
    )
    training_rows = [row for row in rows if row["section"] in ("training", "scale", "storage") and row.get("value")]
    if training_rows:
        figure, ax = plt.subplots(figsize=(7, 0.32 * len(training_rows) + 1))
        labels = [f"{row['contender']} | {row['workload'].split(',')[-1].strip()}" for row in training_rows]
        colors = ["tab:gray" if "PyKEEN" in row["contender"] else "tab:blue" for row in training_rows]
        bars(ax, labels, [row["value"] for row in training_rows], colors, log=True)
        ax.set_xlabel("triples per second (log scale)")
        ax.set_title(data["device"].split(";")[0], fontsize=10)
        text += save(figure, out, name.replace(".json", ".png"))
    return text


def parity(data: dict[str, Any], out: Path) -> str:
    rows = data["summary"]
    columns = [
        ("data", "data"),
        ("variant", "variant"),
        ("num_shards", "n"),
        ("seeds", "seeds"),
        ("mrr", "MRR (mean)"),
        ("mrr_se", "standard error"),
        ("difference", "difference to n = 1"),
        ("difference_se", "its standard error"),
    ]
    text = table(rows, columns)
    # the paired difference from one shard, one line per graph, variant and shard count, with the +-0.01 band
    compared = [row for row in rows if row.get("difference") is not None]
    figure, ax = plt.subplots(figsize=(8, 1.5 + 0.27 * len(compared)))
    ax.axvspan(-0.01, 0.01, color="tab:green", alpha=0.12, label="within 0.01")
    ax.axvline(0.0, color="gray", linewidth=0.8)
    for index, row in enumerate(compared):
        se = row.get("difference_se")
        ax.errorbar(
            row["difference"],
            index,
            xerr=se if se is not None and math.isfinite(se) else 0,
            marker="o",
            markersize=3,
            capsize=2,
            color="tab:blue" if row["num_shards"] == 2 else "tab:orange",
        )
    ax.set_yticks(range(len(compared)))
    ax.set_yticklabels([f"{row['data']}, {row['variant']}, n={row['num_shards']}" for row in compared], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("filtered MRR: n shards minus one shard (paired, ± se)", fontsize=10)
    ax.legend(fontsize=9, loc="lower right")
    return text + save(figure, out, "parity.png")


def generic(data: dict[str, Any], out: Path) -> str:
    """Every table of a result file (its ``tables``, or its one table of ``rows``) with the columns its rows have."""
    text = ""
    for part in data.get("tables") or [{"title": "", "rows": data["rows"]}]:
        keys = list(dict.fromkeys(key for row in part["rows"] for key in row))
        keys = [key for key in keys if any(row.get(key) is not None for row in part["rows"])]
        text += f"\n**{part['title']}**\n\n" if part["title"] else "\n"
        if part.get("command"):
            text += f"Command: `{shown_command(part['command'])}`\n\n"
        text += table(part["rows"], [(key, key.replace("_", " ")) for key in keys])
    if data.get("notes"):
        text += f"\n{data['notes']}\n"
    return text


def distributed(data: dict[str, Any], out: Path) -> str:
    text = generic(data, out)
    rows = data["tables"][0]["rows"]
    figure, ax = plt.subplots(figsize=(6.5, 3))
    labels = [f"{row['layout']} {row['exchange']}" for row in rows]
    bars(ax, labels, [row["bytes_per_step"] for row in rows])
    ax.set_xlabel("bytes per step and rank to the shard group (measured = cost model)")
    ax.set_title(f"{rows[0]['graph']}, {data.get('backend', 'gloo')}", fontsize=10)
    return text + save(figure, out, "distributed.png")


def evaluation_summary(data: Any, out: Path) -> str:
    """BessEvaluator's rows only, for the evaluation how-to: wall times, speed-ups, the one-product ratio."""
    rows = [dict(row) for row in (data if isinstance(data, list) else data["rows"]) if row["name"].startswith("Bess")]
    columns = [
        ("dataset", "dataset"),
        ("setting", "BessEvaluator"),
        ("seconds", "wall time (s)"),
        ("first_seconds", "first evaluation (s)"),
        ("speedup", "speed-up vs PyKEEN best"),
        ("x_one_product", "x one product"),
    ]
    return table(rows, columns)


RENDERERS: dict[str, tuple[str, str, Callable[[Any, Path], str]]] = {
    "training": ("training-cpu.json", "python benchmarks/training.py --output FILE", training),
    "training-pbg": (
        "training-pbg-workload-cpu.json",
        "python benchmarks/training.py --pbg-workload --output FILE",
        training_pbg,
    ),
    "parity": ("parity-cpu.json", "python benchmarks/parity.py --output FILE", parity),
    "quality": ("quality-cpu.json", "python benchmarks/quality.py --output FILE", quality),
    "scale": ("scale-cpu.json", "python benchmarks/scale.py --output FILE", scale),
    "evaluation": ("evaluation-cpu.json", "python benchmarks/evaluation.py --output FILE", evaluation),
    "evaluation-summary": (
        "evaluation-cpu.json",
        "python benchmarks/evaluation.py --output FILE",
        evaluation_summary,
    ),
    "evaluation-models": (
        "evaluation-models-cpu.json",
        "python benchmarks/evaluation_models.py --output FILE",
        generic,
    ),
    "evaluation-ab": (
        "evaluation-ab-cpu.json",
        "python benchmarks/evaluation_ab.py --baseline CHECKOUT --data DIR --output FILE",
        generic,
    ),
    "distributed": ("distributed-cpu.json", "python benchmarks/distributed.py --output FILE", distributed),
    "training-step-ab": (
        "training-step-ab-cpu.json",
        "python benchmarks/training.py --data DIR --baseline CHECKOUT --output FILE",
        generic,
    ),
    "distributed-step-ab": (
        "distributed-step-ab-cpu.json",
        "python benchmarks/distributed.py --data DIR --baseline CHECKOUT --output FILE",
        generic,
    ),
    "distributed-configurations-ab": (
        "distributed-configurations-ab-cpu.json",
        "python benchmarks/distributed.py --data DIR --baseline CHECKOUT --exchanges SCHEME --output FILE",
        generic,
    ),
    "storage": ("storage-cpu.json", "python benchmarks/storage.py --output FILE", generic),
    "checkpoints": ("checkpoints-cpu.json", "python benchmarks/checkpoints.py --output FILE", generic),
    "busy": ("busy-cpu.json", "python benchmarks/busy_cpu.py --output FILE", generic),
    "pbg-import": ("pbg-import-cpu.json", "python benchmarks/pbg_import.py --output FILE", generic),
    "gpu": (
        "gpu-h200.json",
        "python benchmarks/gpu.py --eval-data DATA/wn18rr --output benchmarks/results/gpu-h200.json",
        lambda data, out: gpu(data, out, "gpu-h200.json", ("check", "training", "profile", "evaluation")),
    ),
    "gpu-configurations": (
        "gpu-h200.json",
        "python benchmarks/gpu.py --eval-data DATA/wn18rr --output benchmarks/results/gpu-h200.json",
        lambda data, out: gpu(data, out, "gpu-h200-configurations.json", ("configurations",)),
    ),
    "gpu-evaluation": (
        "gpu-h200.json",
        "python benchmarks/gpu.py --eval-data DATA/wn18rr --output benchmarks/results/gpu-h200.json",
        lambda data, out: gpu(data, out, "gpu-h200-evaluation.json", ("evaluation",)),
    ),
    "gpu-scale-storage": (
        "gpu-h200.json",
        "python benchmarks/gpu.py --eval-data DATA/wn18rr --output benchmarks/results/gpu-h200.json",
        lambda data, out: gpu(data, out, "gpu-h200-scale-storage.json", ("scale", "storage")),
    ),
}


def blocks_figure(path: Path, n: int = 4) -> None:
    """The ``n x n`` shardpair blocks of one step and the two exchange schemes."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw=dict(width_ratios=[1, 1.25]))
    colors = plt.get_cmap("tab10").colors
    for i in range(n):
        for j in range(n):
            left.add_patch(plt.Rectangle((j, n - 1 - i), 0.94, 0.94, color=colors[i], alpha=0.25 + 0.5 * (i == j)))
            left.text(j + 0.47, n - 0.53 - i, f"({i},{j})\nb slots", ha="center", va="center", fontsize=7)
    left.set_xlim(-0.1, n + 0.05)
    left.set_ylim(-0.35, n + 0.05)
    left.set_xticks([j + 0.47 for j in range(n)], [f"tail shard {j}" for j in range(n)], fontsize=7)
    left.set_yticks([n - 0.53 - i for i in range(n)], [f"head shard {i}" for i in range(n)], fontsize=7)
    left.set_title(f"one step: {n}x{n} shardpair blocks of b = ceil(B / n²) positives", fontsize=9)
    left.tick_params(length=0)
    for spine in left.spines.values():
        spine.set_visible(False)
    right.axis("off")
    right.set_xlim(0, 10)
    right.set_ylim(0, 10)
    right.set_title("the two exchanges (process = shard i, heads stay home)", fontsize=9)

    def box(x: float, y: float, text: str, color: str) -> None:
        right.text(x, y, text, ha="center", va="center", fontsize=8, bbox=dict(boxstyle="round", fc=color, alpha=0.35))

    def arrow(x0: float, y0: float, x1: float, y1: float, text: str) -> None:
        right.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", lw=1.3))
        right.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.35, text, ha="center", fontsize=7)

    right.text(5, 9.3, 'embedding-moving (exchange="embedding")', ha="center", fontsize=9, weight="bold")
    box(1.6, 8, "shard j:\ntails t, negatives\n(K/n rows)", "tab:green")
    box(8.4, 8, "shard i:\nheads h, relations r\nscores [b, 1 + K]", "tab:blue")
    arrow(3.2, 8, 6.6, 8, "AllToAll rows (forward); row gradients back")
    right.text(5, 5.3, 'score-moving (exchange="score")', ha="center", fontsize=9, weight="bold")
    box(8.4, 4, "shard i:\nqueries q = f(h, r)", "tab:blue")
    box(1.6, 4, "every shard j:\nscores q x its K/n\nlocal negatives", "tab:green")
    arrow(6.9, 4.3, 3.1, 4.3, "AllGather queries")
    arrow(3.1, 3.5, 6.9, 3.5, "AllToAll scores")
    right.text(
        5,
        1.3,
        'negatives="step" (default): one set of K negatives per step, shared by all n² blocks\n'
        'negatives="block": every block draws its own K',
        ha="center",
        fontsize=8,
    )
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def render(results: Path, out: Path) -> None:
    """Write ``out/NAME.md`` (and plots) for every benchmark, and the explanation's figure."""
    out.mkdir(parents=True, exist_ok=True)
    blocks_figure(out / "bess-blocks.svg")
    for name, (filename, script, renderer) in RENDERERS.items():
        path = results / filename
        if path.exists():
            data = json.loads(path.read_text(encoding="utf-8"))
            body = renderer(data, out)
            if isinstance(data, dict):
                body = provenance(data, filename) + "\n" + body
        else:
            body = missing(filename, script)
        (out / f"{name}.md").write_text(body, encoding="utf-8")


if __name__ == "__main__":
    docs = Path(__file__).resolve().parent
    render(docs.parent / "benchmarks" / "results", docs / "_generated")
    print(f"written to {docs / '_generated'}")
