"""The GPU benchmark: BESS's training step, scale, evaluation and storage tiers against PyKEEN on one GPU, in one run.

One script that a one-GPU machine runs in about five minutes (``--budget`` seconds; a section that
would not fit is skipped and says so) and that needs nothing but this repository and PyKEEN: every
graph is generated in the process. It prints one markdown table, the device's name above it, and
writes the figures as JSON (``--output``):

* **check**: the captured static step (``static_step=None`` on CUDA: every step kind of an epoch
  replayed as a CUDA graph) against the eager step (``static_step=False``) on PyKEEN's bundled
  Nations, three epochs each (DistMult with its default regularizer at n = 1 and n = 4, n = 4 with
  per-block negatives, RotatE with the score-moving exchange): the largest relative difference of
  the epoch losses (float32 on the GPU, so about 1e-6, not 0) and whether the step was captured;
* **training**: DistMult (dimension 256, PyKEEN's default regularizer and loss), 64 negatives per
  positive, Adam, on a generated graph of 272,115 triples (14,505 entities, 237 relations, skewed
  degrees; FB15k-237's size), at batch 4,096 and 512: PyKEEN's stock ``SLCWATrainingLoop`` (timed
  on batches after the first five), BESS's eager step at n = 1 and the static step at n = 1, n = 4
  (one set of negatives per step, the default) and n = 4 with ``negatives="block"`` (the best of
  the epochs after the first). Targets: at least 5M positives/s and 20x stock at batch 4,096, 10x
  stock at batch 512;
* **profile**: ``torch.profiler`` over static steps of the trained loops: kernels, launches
  (``cudaGraphLaunch`` and ``cudaLaunchKernel``), host synchronisations and copies per step, and the
  fraction of the steps' wall time the GPU is busy (the union of the device activities' intervals);
  target at least 80%;
* **configurations** (:mod:`gpu_configurations`): the static step against the eager step in a process
  group of one rank (NCCL, collectives captured; target 0.9x the single-process static step), the
  encoding partition, sub-batches and a per-step callback (each at least 10x eager), and a
  *modelled* row for 2, 4 and 8 GPUs over NVLink (the one-rank step time divided by the GPUs plus
  the exchange cost model's bytes at ``--nvlink-gbps``);
* **scale**: TransE (dimension 100, PyKEEN's default p = 1), 256 negatives, batch 4,096, Adam on a
  generated skewed graph with 2.5M entities (``--scale-entities``, ``--scale-triples``), n = 1 and
  n = 4, the second epoch timed; target at least 10M triples/s;
* **storage**: the training workload at batch 512 and 4,096 (n = 1) with the tables on the device, in
  host memory (``storage="host"``) and in memory-mapped files (``storage="mmap"``, in a temporary
  directory): the static step with every step's rows staged into device buffers (the next step's
  copied in on a side stream while a step runs) and captured, its losses compared with the device
  tier's, and the eager step for comparison; targets host at least 0.8x device, mmap at least 0.5x;
  each row also says how often per step the process' threads slept and were woken (voluntary
  context switches: a thread that keeps an OpenMP team of its own can make every parallel region of
  the host's share of a step sleep and wake its threads, see ``EpochPlans`` in
  ``pykeen_bess/training/epoch_steps.py``);
  and host tables (4M entities, ``--big-entities``) four times the GPU memory the process may use
  (``torch.cuda.set_per_process_memory_fraction``), the model built on the meta device;
* **evaluation**: BessEvaluator against PyKEEN's ``RankBasedEvaluator`` on the same GPU
  (``benchmarks/evaluation.py``'s :func:`evaluation_rows`); targets at least 20x and identical metrics.

    python benchmarks/gpu.py --output gpu.json
    python benchmarks/gpu.py --device cpu --quick     # the same code on tiny sizes (a smoke test)

On the CPU the static step runs uncaptured (``static_step=True``); the figures then say nothing
about a GPU, but every section runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import platform
import resource
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from pykeen.datasets import Nations
from pykeen.models import DistMult, RotatE, TransE
from pykeen.triples import CoreTriplesFactory

from devices import add_device_argument, describe, synchronize
from result_files import write_result
from gpu_configurations import configurations
from pykeen_bess.training import BessTrainingLoop
from scale import generate
from training import EpochClock, generate_graph, steady, time_stock

#: one row of the result table
Row = dict[str, Any]


class Budget:
    """The seconds left of the run; a section asks before it starts."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def static_mode(device: torch.device) -> bool | None:
    """The loop's ``static_step``: automatic on CUDA (captured), forced (uncaptured) on the CPU."""
    return None if device.type == "cuda" else True


def train_bess(
    tf: CoreTriplesFactory,
    model: torch.nn.Module,
    epochs: int,
    batch_size: int,
    **loop_kwargs: Any,
) -> tuple[BessTrainingLoop, list[float], float, float]:
    """Train BESS; return the loop, its epoch losses, the first epoch's and the best later epoch's positives/s."""
    loop = BessTrainingLoop(model=model, triples_factory=tf, automatic_memory_optimization=False, **loop_kwargs)
    device = next(model.parameters()).device
    clock = EpochClock(device)
    synchronize(device)
    start = time.perf_counter()
    losses = loop.train(tf, num_epochs=epochs, batch_size=batch_size, use_tqdm=False, callbacks=clock)
    first, best = steady(start, clock.ends, tf.num_triples)
    static = loop.static
    how = "eager" if static is None else ("captured" if _captured(static) else "static, uncaptured")
    print(f"    trained {epochs} epochs ({how}): first {first:,.0f}/s, best {best:,.0f}/s", flush=True)
    return loop, losses or [], first, best


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _captured(static: Any) -> bool:
    """Whether a static step was replayed as CUDA graphs."""
    return bool(getattr(static.executor, "graphs", {}))


# -- check -----------------------------------------------------------------------------------------


def check(device: torch.device, rows: list[Row], quick: bool = False) -> None:
    """Captured static step against the eager step: epoch losses on Nations; the training L1 distances against cdist."""
    from pykeen_bess.scoring.distances import l1_distances

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 4, 64, 100, generator=generator).to(device).requires_grad_()
    candidates = torch.randn(4, 4, 32, 100, generator=generator).to(device).requires_grad_()
    weights = torch.randn(4, 4, 64, 32, generator=generator).to(device)
    results = []
    for distances in (l1_distances, lambda q, c: torch.cdist(q, c, p=1)):
        value = distances(query, candidates)
        results.append([value, *torch.autograd.grad(value, (query, candidates), weights)])
    difference = max(float((a - b).norm() / b.norm()) for a, b in zip(*results))
    rows.append(
        dict(
            section="check",
            workload="L1 distances [4, 4, 64, 100] x [4, 4, 32, 100], forward and backward",
            contender="training path (compiled on CUDA) vs torch.cdist",
            figure=f"max rel. difference {difference:.1e}",
            target="< 1e-5",
            met=difference < 1e-5,
            value=difference,
        )
    )
    tf = Nations().training
    cases: list[tuple[str, Callable[[], torch.nn.Module], dict]] = [
        ("DistMult n=1", lambda: DistMult(triples_factory=tf, embedding_dim=32, random_seed=0), dict(num_shards=1)),
        ("DistMult n=4", lambda: DistMult(triples_factory=tf, embedding_dim=32, random_seed=0), dict(num_shards=4)),
        (
            "DistMult n=4 block negatives",
            lambda: DistMult(triples_factory=tf, embedding_dim=32, random_seed=0),
            dict(num_shards=4, negatives="block"),
        ),
        (
            "RotatE n=2 score exchange",
            lambda: RotatE(triples_factory=tf, embedding_dim=16, random_seed=0),
            dict(num_shards=2, exchange="score"),
        ),
        ("TransE p=1 n=2", lambda: TransE(triples_factory=tf, embedding_dim=32, random_seed=0), dict(num_shards=2)),
    ]
    for name, make, kwargs in cases[1:3] if quick else cases:
        losses = {}
        captured = False
        for mode in (False, static_mode(device)):
            loop, loss, _, _ = train_bess(
                tf, make().to(device), 3, 128, num_negs_per_pos=16, optimizer="adam", static_step=mode, **kwargs
            )
            losses[mode] = loss
            if mode is not False and loop.static is not None:
                captured = _captured(loop.static)
        eager, static = losses[False], losses[static_mode(device)]
        difference = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager, static))
        rows.append(
            dict(
                section="check",
                workload=f"Nations, {name}, 3 epochs",
                contender="static step vs eager step",
                figure=f"max rel. loss difference {difference:.1e}; captured: {'yes' if captured else 'no'}",
                target="< 1e-4, captured on CUDA",
                met=difference < 1e-4 and (captured or device.type != "cuda"),
                value=difference,
            )
        )


# -- training and profile --------------------------------------------------------------------------


def training(device: torch.device, rows: list[Row], args: argparse.Namespace, loops: dict) -> None:
    """DistMult d256, 64 negatives, Adam: stock PyKEEN, eager BESS and the static step."""
    tf = generate_graph(args.entities, 237, args.triples, seed=0)
    note = f"{tf.num_triples:,} triples, DistMult d{args.dim}, 64 negatives, Adam"
    for batch_size in args.batch_sizes:
        stock = time_stock(tf, args.dim, 64, batch_size, args.stock_batches, device)
        rows.append(
            dict(
                section="training",
                workload=f"{note}, batch {batch_size}",
                contender="PyKEEN stock sLCWA",
                figure=f"{stock:,.0f}/s",
                value=stock,
            )
        )
        gc.collect()
        target_ratio = 20 if batch_size >= 4096 else 10
        contenders = [
            ("BESS eager step, n=1", dict(num_shards=1, static_step=False), 2),
            ("BESS static step, n=1", dict(num_shards=1, static_step=static_mode(device)), 3),
            ("BESS static step, n=4", dict(num_shards=4, static_step=static_mode(device)), 3),
            (
                "BESS static step, n=4, negatives=block",
                dict(num_shards=4, static_step=static_mode(device), negatives="block"),
                3,
            ),
        ]
        for name, kwargs, epochs in contenders:
            model = DistMult(triples_factory=tf, embedding_dim=args.dim, random_seed=0).to(device)
            loop, _, _, best = train_bess(
                tf, model, epochs, batch_size, num_negs_per_pos=64, optimizer="adam", **kwargs
            )
            ratio = best / stock
            static = kwargs["static_step"] is not False
            captured = loop.static is not None and _captured(loop.static)
            target = f">= {target_ratio}x stock" + (" and >= 5M/s" if batch_size >= 4096 else "")
            met = ratio >= target_ratio and (batch_size < 4096 or best >= 5e6)
            if device.type == "cuda":
                met, target = met and captured, target + ", captured"
            rows.append(
                dict(
                    section="training",
                    workload=f"{note}, batch {batch_size}",
                    contender=name,
                    figure=f"{best:,.0f}/s ({ratio:.1f}x stock)" + (f"; captured: {_yes(captured)}" if static else ""),
                    target=target if static else "",
                    met=met if static else None,
                    value=best,
                )
            )
            if static and "negatives" not in kwargs:
                loops[(kwargs["num_shards"], batch_size)] = (loop, tf)
            else:
                del loop
            del model
            gc.collect()


def profile(device: torch.device, rows: list[Row], loops: dict, steps: int = 40) -> None:
    """Per-step launches, synchronisations, copies and the GPU's busy fraction of trained static steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for (n, batch_size), (loop, _) in sorted(loops.items()):
        static = loop.static
        if static is None:
            continue
        sampler = static.sampler
        with loop.tables.installed(copy_weights=True):
            fields = static.host_plan(sampler.draw_epoch(loop._epoch + 1, static.num_steps))
            static.load_plan(fields)
            count = min(steps, static.num_steps)
            static.run(min(3, count))  # warm (the graph exists already after training)
            static.finish_epoch()
            static.load_plan(fields)
            synchronize(device)
            with torch_profile(activities=activities) as prof:
                start = time.perf_counter()
                static.run(count)
                synchronize(device)
                wall = time.perf_counter() - start
            static.finish_epoch()
        events = prof.events()
        names: dict[str, int] = {}
        intervals = []
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA:
                intervals.append((event.time_range.start, event.time_range.end))
            else:
                names[event.name] = names.get(event.name, 0) + 1
        busy = _union(intervals) / 1e6
        launches = names.get("cudaGraphLaunch", 0) + names.get("cudaLaunchKernel", 0) + names.get("cuLaunchKernel", 0)
        syncs = sum(v for k, v in names.items() if "Synchronize" in k)
        copies = sum(v for k, v in names.items() if k.startswith("cudaMemcpy"))
        fraction = busy / wall if wall > 0 else float("nan")
        rows.append(
            dict(
                section="profile",
                workload=f"DistMult static step, batch {batch_size}",
                contender=f"n={n}",
                figure=(
                    f"{len(intervals) / count:.0f} kernels, {launches / count:.1f} launches, {syncs / count:.2f} "
                    f"syncs, {copies / count:.2f} copies per step; {1e3 * wall / count:.3f} ms/step, GPU busy "
                    f"{100 * fraction:.0f}%"
                ),
                target=">= 80% busy" if device.type == "cuda" else "",
                met=fraction >= 0.8 if device.type == "cuda" else None,
                value=fraction,
            )
        )


def _union(intervals: list[tuple[float, float]]) -> float:
    """The total length of the union of ``(start, end)`` intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


# -- scale -----------------------------------------------------------------------------------------


def scale(device: torch.device, rows: list[Row], args: argparse.Namespace, budget: Budget) -> None:
    """TransE d100 p=1, 256 negatives, batch 4096 on a generated graph of wikikg2's entity count."""
    started = time.perf_counter()
    triples = generate(args.scale_entities, 500, args.scale_triples)
    tf = CoreTriplesFactory.create(mapped_triples=triples, num_entities=args.scale_entities, num_relations=500)
    print(f"  generated {tf.num_triples:,} triples in {time.perf_counter() - started:.1f} s", flush=True)
    for n, norm in [(1, 1), (4, 1), *[(1, p) for p in args.scale_norms if p != 1]]:
        if budget.left() < 45:
            rows.append(dict(section="scale", workload="", contender=f"n={n}, p={norm}", figure="skipped (budget)"))
            continue
        started = time.perf_counter()
        model = TransE(triples_factory=tf, embedding_dim=100, scoring_fct_norm=norm, random_seed=0).to(device)
        loop, _, first, best = train_bess(
            tf,
            model,
            2,
            4096,
            num_shards=n,
            num_negs_per_pos=256,
            optimizer="adam",
            optimizer_kwargs=dict(lr=1e-3),
            static_step=static_mode(device),
        )
        rows.append(
            dict(
                section="scale",
                workload=(
                    f"{args.scale_entities:,} entities, {tf.num_triples:,} triples, TransE d100 p={norm}, 256 "
                    "negatives, batch 4096"
                ),
                contender=f"BESS static step, n={n}",
                figure=f"{best:,.0f}/s (first epoch {first:,.0f}/s; run {time.perf_counter() - started:.0f} s)",
                target=">= 10M/s",
                met=best >= 1e7,
                value=best,
            )
        )
        del loop, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# -- storage -----------------------------------------------------------------------------------------


#: the epochs each storage row trains (the second is timed)
STORAGE_EPOCHS = 2


def storage(device: torch.device, rows: list[Row], args: argparse.Namespace) -> None:
    """The same training with the tables on the device, in host memory and in files (n=1)."""
    import tempfile

    tf = generate_graph(args.entities, 237, args.triples, seed=0)
    targets = {"host": 0.8, "mmap": 0.5}
    for batch_size in (512, 4096) if not args.quick else (512,):
        rates: dict[str, tuple[float, bool]] = {}
        losses: dict[str, list[float]] = {}
        depths: dict[str, int] = {}
        switches: dict[str, float] = {}  # voluntary context switches of the process per training step
        runs = {
            "storage='device'": ("device", static_mode(device)),
            "storage='host'": ("host", static_mode(device)),  # its rows staged around every step
            "storage='mmap'": ("mmap", static_mode(device)),
            "storage='host', eager step": ("host", False),
        }
        for contender, (tier, mode) in runs.items():
            with tempfile.TemporaryDirectory() as directory:
                options = dict(storage_path=directory) if tier == "mmap" else {}
                model = DistMult(triples_factory=tf, embedding_dim=args.dim, random_seed=0).to(device)
                before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                loop, losses[contender], _, rate = train_bess(
                    tf,
                    model,
                    STORAGE_EPOCHS,
                    batch_size,
                    num_shards=1,
                    num_negs_per_pos=64,
                    optimizer="adam",
                    storage=tier,
                    static_step=mode,
                    **options,
                )
                steps = STORAGE_EPOCHS * math.ceil(tf.num_triples / batch_size)
                switches[contender] = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / steps
                rates[contender] = (rate, loop.static is not None and _captured(loop.static))
                depths[contender] = getattr(loop.static.rows_io, "depth", 0) if loop.static is not None else 0
                del loop, model
                gc.collect()
        device_rate = rates["storage='device'"][0]
        device_losses = losses["storage='device'"]
        for contender, (rate, captured) in rates.items():
            tier = contender.split("'")[1]
            ratio = rate / device_rate
            target = targets.get(tier) if "eager" not in contender else None
            # the staged steps' losses against the device tier's (the same arithmetic: float rounding apart)
            difference = max(
                (abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[contender], device_losses)), default=0.0
            )
            staged = f"; staging depth {depths[contender]}" if depths[contender] else ""
            rows.append(
                dict(
                    section="storage",
                    workload=f"{tf.num_triples:,} triples, DistMult d{args.dim}, batch {batch_size}, n=1",
                    contender=contender,
                    figure=f"{rate:,.0f}/s"
                    + (f" ({ratio:.2f}x device; losses {difference:.1e} from it)" if tier != "device" else "")
                    + ("" if "eager" in contender else f"; captured: {_yes(captured)}{staged}")
                    + f"; {switches[contender]:.1f} context switches per step",
                    target=f">= {target}x device, losses within 1e-4" if target else "",
                    met=ratio >= target and difference <= 1e-4 if target else None,
                    value=rate,
                    loss_difference=difference,
                    context_switches_per_step=switches[contender],
                )
            )
    bigger_than_the_device(device, rows, args)


def bigger_than_the_device(device: torch.device, rows: list[Row], args: argparse.Namespace) -> None:
    """Host tables four times the GPU memory the process may use: a model built on the meta device, staged rows."""
    entities, triples = (5_000, 20_000) if args.quick else (args.big_entities, 1_000_000)
    tf = generate_graph(entities, 237, triples, seed=1)
    with torch.device("meta"):  # PyKEEN's constructor allocates no full table
        model = DistMult(triples_factory=tf, embedding_dim=args.dim, random_seed=0, regularizer=None)
    table_bytes = entities * args.dim * 4 * 3  # the weights and Adam's two moments (float32)
    allowed = table_bytes // 4
    cuda = device.type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(allowed / total, device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        loop, _, first, _ = train_bess(
            tf,
            model,
            1,
            4096,
            num_shards=1,
            num_negs_per_pos=64,
            optimizer="adam",
            storage="host",
            static_step=static_mode(device),
            device=device,
            memory_budget=allowed,  # the staging buffers and the replicated parameters fit in it
        )
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        captured = loop.static is not None and _captured(loop.static)
        depth = getattr(loop.static.rows_io, "depth", 0) if loop.static is not None else 0
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    gib = 2**30
    rows.append(
        dict(
            section="storage",
            workload=f"{entities:,} entities, {tf.num_triples:,} triples, DistMult d{args.dim}, batch 4096, n=1",
            contender="storage='host', tables 4x the GPU memory allowed",
            figure=f"{first:,.0f}/s (one epoch); tables and Adam state {table_bytes / gib:.2f} GiB in host memory, "
            f"GPU allowed {allowed / gib:.2f} GiB (memory_budget), peak {peak / gib:.2f} GiB; captured: "
            f"{_yes(captured)}" + (f"; staging depth {depth}" if depth else ""),
            target="trains within the allowed memory" if cuda else "",
            met=peak <= allowed if cuda else None,
            value=first,
        )
    )


# -- evaluation ----------------------------------------------------------------------------------------


def evaluation(device: torch.device, rows: list[Row], args: argparse.Namespace) -> None:
    """BessEvaluator against PyKEEN's RankBasedEvaluator on the same GPU (``benchmarks/evaluation.py``)."""
    from evaluation import evaluation_rows

    generated = "500:10:6000:200" if args.quick else "14505:237:272115:2000"
    measured = evaluation_rows(
        device,
        data=args.eval_data,
        generated=generated,
        dim=args.dim,
        train_epochs=1 if args.quick else 5,
        repeats=1 if args.quick else 3,
        profile=True,
    )
    for row in measured:
        bess = row["name"].startswith("Bess")
        speedup = row.get("speedup")
        equal = row.get("metrics_equal")
        figure = f"{row['seconds']:.3f} s"
        if speedup is not None:
            figure += f", {speedup:.1f}x PyKEEN"
        figure += f", {row['percent_of_matmul']:.0f}% of the matmul rate, {row['x_one_product']:.2f}x one product"
        if bess and "first_seconds" in row:
            figure += f", first evaluation {row['first_seconds']:.3f} s"
        if bess and equal is not None:
            figure += f"; metrics {'equal' if equal else 'NOT equal'} (max rel. difference {row['max_rel_diff']:.1e})"
        rows.append(
            dict(
                section="evaluation",
                workload=f"{row['dataset']}, filtered, both sides, DistMult d{args.dim}",
                contender=f"{row['name']} {row['setting']}",
                figure=figure,
                target=">= 20x PyKEEN, >= 30% of matmul, equal metrics" if bess else "",
                met=(bool(equal) and speedup >= 20 and row["percent_of_matmul"] >= 30) if bess and speedup else None,
                value=row["seconds"],
            )
        )
        if bess and row.get("profile"):
            rows.append(_evaluation_profile(row, args.dim))


def _evaluation_profile(row: Row, dim: int) -> Row:
    """The profiler's view of one more evaluation of a BessEvaluator row: where its time goes."""
    profile, stages = row["profile"], row.get("timings") or {}
    busy = profile["device_busy"]
    host = ", ".join(f"{name} {ms:.1f} ms/{calls}" for name, ms, calls in profile["host_ops"])
    return dict(
        section="profile",
        workload=f"{row['dataset']}, evaluation, DistMult d{dim}",
        contender=f"{row['name']} {row['setting']}",
        figure=(
            f"{profile['seconds']:.3f} s profiled; {profile['kernels']} kernels, {profile['syncs']} syncs"
            + ("" if busy is None else f", GPU busy {100 * busy:.0f}%")
            + "; stages of the last timed (unprofiled) evaluation "
            + ", ".join(f"{stage} {1e3 * seconds:.1f} ms" for stage, seconds in stages.items())
            + f"; busiest host operators (self time/calls): {host}"
        ),
        value=busy,
    )


# -- main --------------------------------------------------------------------------------------------


SECTIONS = ("check", "training", "profile", "configurations", "scale", "storage", "evaluation")


def main() -> None:  # noqa: C901  # one branch per section, run in order
    """Run the sections in order and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--budget", type=float, default=290.0, help="seconds for all sections (later ones skip)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes (a smoke test of the script): replaces the size options, and every section runs whatever the "
        "budget",
    )
    parser.add_argument("--entities", type=int, default=14_505)
    parser.add_argument("--triples", type=int, default=272_115)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4096, 512])
    parser.add_argument("--stock-batches", type=int, default=40)
    parser.add_argument("--scale-entities", type=int, default=2_500_000)
    parser.add_argument("--scale-triples", type=int, default=17_000_000)
    parser.add_argument("--scale-norms", type=int, nargs="+", default=[1], help="TransE's p (1: the target)")
    parser.add_argument("--big-entities", type=int, default=4_000_000, help="entities of the host-tables row")
    parser.add_argument("--eval-data", default=None, help="a dataset directory also evaluated (e.g. WN18RR)")
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    parser.add_argument("--nvlink-gbps", type=float, default=300.0, help="the modelled rows' bandwidth per direction")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.entities, args.triples, args.dim = 500, 6_000, 16
        args.batch_sizes, args.stock_batches = [256, 64], 5
        args.scale_entities, args.scale_triples = 2_000, 20_000
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pykeen").setLevel(logging.WARNING)  # PyKEEN's modules log every representation at INFO
    device = args.device
    heading = f"{describe(device)}; torch {torch.__version__}, Python {platform.python_version()}"
    print(heading, flush=True)
    budget = Budget(args.budget)
    rows: list[Row] = []
    failed: list[str] = []
    loops: dict = {}
    configuration = (
        f"sections {', '.join(args.sections)}; budget {args.budget:.0f} s; {args.entities:,} entities, "
        f"{args.triples:,} triples, d{args.dim}, batch sizes {args.batch_sizes}" + (" (--quick)" if args.quick else "")
    )
    minimum = {
        "check": 20,
        "training": 60,
        "profile": 10,
        "configurations": 60,
        "scale": 90,
        "storage": 40,
        "evaluation": 30,
    }
    for section in args.sections:
        if budget.left() < minimum[section] and not args.quick:
            rows.append(dict(section=section, workload="", contender="", figure="skipped (time budget)"))
            continue
        started = time.perf_counter()
        print(f"== {section}", flush=True)
        # every section compiles afresh: one process trains many models here, and a module-level compiled
        # function (the training path's L1 distances) keeps a variant per shape and dtype up to torch's
        # limit of recompilations, beyond which it runs uncompiled
        torch.compiler.reset()
        try:
            if section == "check":
                check(device, rows, args.quick)
            elif section == "training":
                training(device, rows, args, loops)
            elif section == "profile":
                profile(device, rows, loops)
            elif section == "configurations":
                configurations(device, rows, args)
            elif section == "scale":
                scale(device, rows, args, budget)
            elif section == "storage":
                storage(device, rows, args)
            else:
                evaluation(device, rows, args)
        except Exception as error:  # noqa: BLE001 - a failing section is reported, the others still run
            traceback.print_exc()
            failed.append(section)
            rows.append(dict(section=section, workload="", contender="", figure=f"failed: {error!r}"[:300]))
        print(f"   ({time.perf_counter() - started:.0f} s)", flush=True)
        for row in rows:
            if row["section"] == section:
                print(f"   {row.get('contender', '')}: {row.get('figure', '')}", flush=True)
        if args.output:  # after every section: a run cut short keeps what it measured
            write_result(args.output, "gpu", "benchmarks/gpu.py", rows, configuration, device=heading)
        if section == "scale":
            loops.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print(heading)
    print()
    print("| section | workload | contender | figure | target | met |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        met = {True: "yes", False: "**no**", None: ""}[row.get("met")]
        print(
            f"| {row['section']} | {row.get('workload', '')} | {row.get('contender', '')} | {row.get('figure', '')} "
            f"| {row.get('target', '')} | {met} |"
        )
    if failed:  # (their rows say so, and the result file keeps the other sections)
        raise SystemExit(f"Sections failed: {', '.join(failed)} (see their tracebacks above).")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
