"""What the checkpoints' digests cost: writing and resuming a checkpoint of a large table, with and without them.

For each storage tier (``--tiers``, default device mmap) one process builds DistMult with
``--entities`` entities of dimension ``--dim`` (Adam: the table and its two moments are written),
trains one epoch on a few triples so that the optimizer holds its state, and then writes the
checkpoint ``--repeats`` times with the digests (as every checkpoint is written) and, alternately,
without them (torch's record digests turned off, the ``.npy`` copies' digests skipped), and times
the check a resume runs first (:func:`pykeen_bess.training.checkpoints.files.verify_checkpoint`)
against loading the file. Each write starts after ``os.sync()``, so that the previous write's pages
are not flushed during it. It reports the median wall time of each and the ratio of the write
times, and the same for the process's CPU time (``time.process_time``, every thread's), which other
processes on the machine disturb less.

    python benchmarks/checkpoints.py --directories /dev/shm /var/tmp --output benchmarks/results/checkpoints-cpu.json

``--directories`` writes one table per directory: on a memory file system (``/dev/shm``) the digests'
share of a write is largest; on a disk the write's own time dominates.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from result_files import command_line, write_result


@contextlib.contextmanager
def without_digests() -> Iterator[None]:
    """While the block runs, checkpoints are written as they were before they carried digests."""
    import torch

    import pykeen_bess.storage.digests as digests
    import pykeen_bess.storage.files as files

    saved = files.crc32_of_file, digests.add_record_digests
    before = torch.serialization.get_crc32_options()
    files.crc32_of_file = lambda path: 0  # type: ignore[assignment]
    digests.add_record_digests = lambda path, threads=2: None  # type: ignore[assignment]
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        files.crc32_of_file, digests.add_record_digests = saved
        torch.serialization.set_crc32_options(before)


def measure(tier: str, entities: int, dim: int, repeats: int, directory: pathlib.Path) -> dict[str, Any]:
    """Write and check one tier's checkpoint ``repeats`` times each way; return the row."""
    import torch
    from pykeen.models import DistMult
    from pykeen.triples import CoreTriplesFactory

    from pykeen_bess import BessTrainingLoop
    from pykeen_bess.training.checkpoints.files import verify_checkpoint

    generator = torch.Generator().manual_seed(0)
    triples = torch.stack(
        [torch.randint(entities, (2048,), generator=generator), torch.randint(8, (2048,), generator=generator)]
        + [torch.randint(entities, (2048,), generator=generator)],
        dim=1,
    )
    factory = CoreTriplesFactory.create(mapped_triples=triples, num_entities=entities, num_relations=8)
    storage = dict(storage_path=directory / f"tables-{tier}") if tier == "mmap" else {}
    if storage:
        storage["storage_path"].mkdir()
    loop = BessTrainingLoop(
        model=DistMult(triples_factory=factory, embedding_dim=dim, random_seed=0),
        triples_factory=factory,
        num_shards=2,
        optimizer="adam",
        storage=tier,
        automatic_memory_optimization=False,
        **storage,
    )
    loop.train(factory, num_epochs=1, batch_size=1024, use_tqdm=False)
    path = directory / f"{tier}.pt"
    times: dict[str, list[float]] = {
        kind: [] for kind in ("with", "without", "with cpu", "without cpu", "verify", "load")
    }
    for repeat in range(repeats):
        for kind in ("without", "with") if repeat % 2 == 0 else ("with", "without"):  # each first as often
            with without_digests() if kind == "without" else contextlib.nullcontext():
                os.sync()  # the previous write's dirty pages go to disk first, not during this write
                start, cpu = time.perf_counter(), time.process_time()
                loop._save_state(path)
                times[kind].append(time.perf_counter() - start)
                times[f"{kind} cpu"].append(time.process_time() - cpu)
            if kind == "with":  # what a resume reads first: the check, then the file itself
                start = time.perf_counter()
                verify_checkpoint(path)
                times["verify"].append(time.perf_counter() - start)
                start = time.perf_counter()
                torch.load(path, weights_only=False)
                times["load"].append(time.perf_counter() - start)
    written = path.stat().st_size + sum(p.stat().st_size for p in directory.glob(f"{tier}.pt.tables-*/*"))
    median = {kind: statistics.median(values) for kind, values in times.items()}
    return {
        "storage": tier,
        "entities": entities,
        "dim": dim,
        "checkpoint MB": round(written / 2**20),
        "write with digests s": round(median["with"], 3),
        "write without s": round(median["without"], 3),
        "write ratio": round(median["with"] / median["without"], 3),
        "write CPU with digests s": round(median["with cpu"], 3),
        "write CPU without s": round(median["without cpu"], 3),
        "write CPU ratio": round(median["with cpu"] / median["without cpu"], 3),
        "verify s": round(median["verify"], 3),
        "torch.load s": round(median["load"], 3),
        "repeats": repeats,
    }


def filesystem(place: pathlib.Path | None) -> str:
    """The type of the file system holding ``place`` (``tmpfs``: memory; else a disk), from ``/proc/mounts``."""
    target = pathlib.Path(place or tempfile.gettempdir()).resolve()
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and str(target).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def main() -> None:
    """Measure every tier and print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entities", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tiers", nargs="+", default=["device", "mmap"], choices=["device", "host", "mmap"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--directories",
        type=pathlib.Path,
        nargs="+",
        default=[None],
        help="where the files go, one table each (default: the system's temporary directory)",
    )
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    rows = []
    for place in args.directories:
        for tier in args.tiers:
            with tempfile.TemporaryDirectory(dir=place) as directory:
                row = measure(tier, args.entities, args.dim, args.repeats, pathlib.Path(directory))
            rows.append({"directory": str(place or tempfile.gettempdir()), "filesystem": filesystem(place), **row})
            print(rows[-1], flush=True)
    if args.output is not None:
        configuration = (
            f"DistMult, {args.entities:,} entities x {args.dim}, Adam (table and two moments), 2 logical shards; "
            f"median of {args.repeats} writes each way, alternately"
        )
        write_result(
            args.output,
            "checkpoints",
            "benchmarks/checkpoints.py",
            rows,
            configuration,
            command=command_line("benchmarks/checkpoints.py"),
        )


if __name__ == "__main__":
    main()
