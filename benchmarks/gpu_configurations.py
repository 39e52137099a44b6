"""The ``configurations`` section of ``benchmarks/gpu.py``: the configurations BESS exists for, on the static step.

The training workload of ``gpu.py`` (DistMult, 64 negatives per positive, Adam, batch 512) trained
with the static step (captured as CUDA graphs on CUDA) and with the eager step, in each of:

* a ``torch.distributed`` process group of one rank (NCCL on CUDA, gloo on the CPU; started as
  ``torchrun`` starts ranks, :func:`pykeen_bess.distributed.harness.launch`): the step with its
  collectives captured; target at least 0.9x the single-process static step;
* the encoding partition (``exchange="encoding"``, four column parts in one process);
* sub-batches (four per step);
* a callback that asks for every step's loss (``on_batch``);
* dense updates (``sparse_updates=False``): AdamW's capturable form updates the whole table on the
  device (captured); SGD with momentum, which has no capturable form, updates it after a host read, so
  that step runs uncaptured (target: at least the eager step);

each captured static step at least 10x its eager step on the same GPU. A machine with one GPU cannot run
replicas (every replica group needs two ranks, and NCCL refuses two ranks on one GPU); and it
cannot run more than one rank, so a **modelled** row gives the throughput of ``n = 2, 4, 8`` GPUs:
the measured one-rank step time divided by ``n`` (every rank scores its ``1 / n`` of the blocks)
plus the bytes the exchange cost model (:func:`pykeen_bess.schemes.exchange_cost`) moves per rank
and step, forward and backward, at NVLink's bandwidth (``--nvlink-gbps``, 300 GB/s per direction
by default, about what an H100's NVLink 4 sustains in all-to-all), labelled as a model.

Run as a worker (``--worker``) it trains one rank and writes its rates as JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time
from typing import Any

import torch
from pykeen.models import DistMult
from pykeen.training import TrainingCallback

from training import EpochClock, generate_graph, steady

__all__ = ["configurations"]

#: one row of the result table
Row = dict[str, Any]


class LossPerStep(TrainingCallback):
    """A callback that asks for every step's loss (the static step then reads it on the host every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_batch(self, epoch: int, batch: Any, batch_loss: float, **kwargs: Any) -> None:
        self.losses.append(batch_loss)


def _rate(
    tf: Any, dim: int, device: torch.device, epochs: int, batch_size: int, static: bool | None, **kwargs: Any
) -> tuple[float, float, bool]:
    """Train; return the best steady epoch's positives/s, its seconds per step, and whether the step was captured."""
    from pykeen_bess.training import BessTrainingLoop

    callbacks: list[TrainingCallback] = [EpochClock(device)]
    if kwargs.pop("per_step_callback", False):
        callbacks.append(LossPerStep())
    train_kwargs = {key: kwargs.pop(key) for key in ("sub_batch_size",) if key in kwargs}
    model = DistMult(triples_factory=tf, embedding_dim=dim, random_seed=0).to(device)
    kwargs.setdefault("optimizer", "adam")
    loop = BessTrainingLoop(
        model=model,
        triples_factory=tf,
        automatic_memory_optimization=False,
        num_negs_per_pos=64,
        static_step=static,
        **kwargs,
    )
    start = time.perf_counter()
    loop.train(tf, num_epochs=epochs, batch_size=batch_size, use_tqdm=False, callbacks=callbacks, **train_kwargs)
    _, best = steady(start, callbacks[0].ends, tf.num_triples)
    steps = len(loop.epoch_batches(tf, batch_size=batch_size))
    captured = loop.static is not None and loop.static.capture and bool(getattr(loop.static.executor, "graphs", {}))
    return best, tf.num_triples / best / steps, captured


def _static_mode(device: torch.device) -> bool | None:
    return None if device.type == "cuda" else True


def worker(args: argparse.Namespace) -> None:
    """Train in a process group of one rank (static, then eager); write the rates as JSON."""
    from pykeen_bess.distributed import init_from_environment

    init_from_environment(backend="nccl" if args.device.type == "cuda" else "gloo")
    tf = generate_graph(args.entities, 237, args.triples, seed=0)
    result = {}
    for name, static in (("static", _static_mode(args.device)), ("eager", False)):
        best, step_seconds, captured = _rate(tf, args.dim, args.device, 3, args.batch_size, static)
        result[name] = dict(rate=best, step_seconds=step_seconds, captured=captured)
    pathlib.Path(args.result).write_text(json.dumps(result))


def _process_group_of_one(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Start one rank of :func:`worker` as ``torchrun`` would; return its rates."""
    from pykeen_bess.distributed import harness

    with tempfile.TemporaryDirectory() as directory:
        result = pathlib.Path(directory) / "rank0.json"
        command = [__file__, "--worker", "--result", str(result), "--device", str(device)]
        command += ["--entities", str(args.entities), "--triples", str(args.triples), "--dim", str(args.dim)]
        command += ["--batch-size", "512"]
        launched = harness.launch(1, command, timeout=900, collective_timeout=300, threads=torch.get_num_threads())
        if not launched.ok:
            raise RuntimeError(launched.report())
        return json.loads(result.read_text())


def configurations(device: torch.device, rows: list[Row], args: argparse.Namespace) -> None:
    """Static against eager step for the configurations BESS exists for; the modelled multi-GPU rows."""
    from pykeen_bess.schemes import exchange_cost

    tf = generate_graph(args.entities, 237, args.triples, seed=0)
    note = f"{tf.num_triples:,} triples, DistMult d{args.dim}, 64 negatives, Adam, batch 512"
    single, single_step, _ = _rate(tf, args.dim, device, 3, 512, _static_mode(device), num_shards=1)
    group = _process_group_of_one(device, args)
    ratio = group["static"]["rate"] / single
    rows.append(
        dict(
            section="configurations",
            workload=note,
            contender="process group of one rank" + (" (NCCL)" if device.type == "cuda" else " (gloo)"),
            figure=(
                f"static {group['static']['rate']:,.0f}/s ({ratio:.2f}x the single-process static step, "
                f"{group['static']['rate'] / group['eager']['rate']:.1f}x eager); captured: "
                f"{'yes' if group['static']['captured'] else 'no'}"
            ),
            target=">= 0.9x single process, >= 10x eager, captured" if device.type == "cuda" else "",
            met=(
                ratio >= 0.9 and group["static"]["rate"] >= 10 * group["eager"]["rate"] and group["static"]["captured"]
            )
            if device.type == "cuda"
            else None,
            value=group["static"]["rate"],
        )
    )
    cases = [  # (name, loop and train options, whether a GPU captures the step)
        ("encoding partition, 4 column parts", dict(num_shards=4, exchange="encoding"), True),
        ("sub-batches (4 per step)", dict(num_shards=1, sub_batch_size=128), True),
        ("a callback reading every step's loss", dict(num_shards=1, per_step_callback=True), True),
        # AdamW's capturable form updates the whole table on the device
        ("dense updates, AdamW", dict(num_shards=1, optimizer="adamw", sparse_updates=False), True),
        # SGD with momentum has no capturable form: the user's optimizer after a host read, uncaptured on a GPU
        (
            "dense updates, SGD with momentum (uncaptured)",
            dict(num_shards=1, optimizer="sgd", optimizer_kwargs=dict(lr=0.1, momentum=0.9), sparse_updates=False),
            False,
        ),
    ]
    for name, kwargs, captures in cases:
        static, _, captured = _rate(tf, args.dim, device, 3, 512, _static_mode(device), **dict(kwargs))
        eager, _, _ = _rate(tf, args.dim, device, 2, 512, False, **dict(kwargs))
        speedup = static / eager
        gpu = device.type == "cuda"
        rows.append(
            dict(
                section="configurations",
                workload=note,
                contender=name,
                figure=f"static {static:,.0f}/s, eager {eager:,.0f}/s ({speedup:.1f}x); captured: "
                f"{'yes' if captured else 'no'}",
                target=(">= 10x eager, captured" if captures else ">= eager") if gpu else "",
                met=(speedup >= 10 and captured if captures else speedup >= 1) if gpu else None,
                value=static,
            )
        )
    rows.append(
        dict(
            section="configurations",
            workload=note,
            contender="replicas",
            figure="not measurable here: a replica group needs two ranks, and NCCL refuses two ranks on one GPU",
        )
    )
    step = group["static"]["step_seconds"]
    bandwidth = args.nvlink_gbps * 1e9
    for gpus in (2, 4, 8):
        block = -(-512 // gpus**2)
        sent = 2 * exchange_cost("embedding", gpus, block, 64, args.dim, args.dim, shared_negatives=True)
        modelled = step / gpus + sent / bandwidth
        rows.append(
            dict(
                section="configurations",
                workload=note,
                contender=f"MODEL: {gpus} GPUs over NVLink",
                figure=(
                    f"{512 / modelled:,.0f}/s modelled: one rank's measured step {1e3 * step:.3f} ms / {gpus} + "
                    f"{sent / 1e3:.0f} kB per rank and step at {args.nvlink_gbps:.0f} GB/s"
                ),
                value=512 / modelled,
            )
        )


def main() -> None:
    """Run as a rank of :func:`_process_group_of_one`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--result", required=True)
    parser.add_argument("--device", type=torch.device, required=True)
    parser.add_argument("--entities", type=int, required=True)
    parser.add_argument("--triples", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    args = parser.parse_args()
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
    worker(args)


if __name__ == "__main__":
    main()
