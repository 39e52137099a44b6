"""Distributed BESS on gloo: throughput, bytes moved per step and peak memory per rank.

For every layout ``--layouts`` (``SHARDSxREPLICAS``, default 1x1 2x1 4x1 2x2 1x4; the world size
is their product) and every exchange scheme (the token partition's ``embedding`` and ``score``;
the encoding partition's ``encoding``, one column part per rank, for layouts without replicas;
``encoding_lookup`` on request: whole rows assembled from the parts),
one epoch of DistMult (dimension 256, 64 negatives per positive, global batch 512, no entity
constraint or regularizer) is trained with one process per rank on this machine (gloo on
loopback; 1x1 means a single process without a process group), on WN18RR and on a generated
graph whose entity degrees are skewed (``--skewed ENTITIES:RELATIONS:TRIPLES``, Zipf exponent 1.1;
hub entities make some shardpairs much larger than others, so the token plan pads). Each rank
measures the bytes its shard (or column) collectives sent to other ranks (forward and backward),
the bytes it sent to its replicas to sum the shard's gradients, and its peak resident memory; the
table compares the bytes with the cost models of :func:`pykeen_bess.schemes.exchange_cost`
(forward bytes, doubled for the backward pass; the encoding scheme's backward sends nothing:
:meth:`pykeen_bess.schemes.EncodingScheme.batch_cost`) and
:func:`pykeen_bess.schemes.replica_cost` (an upper bound), and gives the steps of the epoch (the
token plan's padding makes more of them).

    python benchmarks/distributed.py --data ../shared/data/wn18rr --skewed 40000:50:300000

``--output FILE.json`` writes the table, one per graph, as the benchmarks page reads it
(:mod:`result_files`). ``--baseline DIR`` times instead the ranks of this checkout against those of
another (e.g. ``git worktree add DIR COMMIT`` of the commit before a change), alternately,
``--ab-runs`` pairs per layout and exchange, and writes the medians and ratios.

On a GPU machine pass ``--backend nccl``: every rank computes on its own GPU (``LOCAL_RANK``), so
every layout's world size must be at most the number of GPUs (checked before any rank starts).
``--dense-updates`` trains every run with ``sparse_updates=False``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import tempfile
import time

from result_files import commit, paired_columns, write_result

#: the schemes of the encoding partition (one column part per rank; no replicas in these runs)
COLUMN_SCHEMES = ("encoding", "encoding_lookup")


def _peak_rss() -> int:
    with open("/proc/self/status") as file:
        return int(re.search(r"VmHWM:\s+(\d+)", file.read()).group(1)) * 1024


def worker(args: argparse.Namespace) -> None:
    """Train one epoch as one rank and write the measurements."""
    import torch
    from pykeen.models import DistMult
    from pykeen.triples import TriplesFactory

    from pykeen_bess.distributed import init_from_environment
    from pykeen_bess.schemes import EncodingScheme, exchange_cost, query_width, replica_cost
    from pykeen_bess.schemes.encoding_lookup import EncodingLookupScheme
    from pykeen_bess.training import BessTrainingLoop

    torch.set_num_threads(args.threads)
    init_from_environment(backend=args.backend)
    factory = TriplesFactory.from_path(args.data / "train.txt")
    model = DistMult(
        triples_factory=factory, embedding_dim=args.dim, random_seed=0, entity_constrainer=None, regularizer=None
    )
    if args.backend == "nccl":
        model = model.to("cuda")
    encoding = args.exchange in COLUMN_SCHEMES
    loop = BessTrainingLoop(
        model=model,
        triples_factory=factory,
        num_shards=args.shards if not (encoding and args.world_size > 1) else None,
        replicas=args.replicas if args.world_size > 1 and not encoding else None,
        exchange=args.exchange,
        num_negs_per_pos=args.negatives,
        optimizer="adam",
        sparse_updates=not args.dense_updates,
        automatic_memory_optimization=False,
        seed=0,
        num_threads="auto",  # the command line's settings of the process
        host_allocator="auto",
    )
    start = time.perf_counter()
    loop.train(factory, num_epochs=1, batch_size=args.batch_size, use_tqdm=False)
    if args.backend == "nccl":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if args.timing_only:  # (--baseline: another checkout's package, whose cost models may differ)
        result = dict(rank=loop.topology.rank, seconds=seconds, triples=factory.num_triples)
        (args.rank_output / f"rank{result['rank']}.json").write_text(json.dumps(result))
        return
    topology = loop.topology
    n = topology.n_shard
    block_size = -(-args.batch_size // n**2)
    steps = len(loop.make_sampler(loop.partition(factory), block_size))
    first, last = topology.replica_slots(block_size)
    entity_width = sum(t.whole_width or t.row_width for t in loop.tables)  # whole rows (a column part's too)
    if args.exchange == "encoding_lookup":  # whole rows' slices forward, their gradients backward
        parts = topology.n_column
        block = -(-args.batch_size // parts**2)
        predicted = EncodingLookupScheme.cost(parts, block, args.negatives, entity_width, 0, element_size=4)
    elif encoding:  # one block of the whole batch; the backward pass sends nothing
        predicted = EncodingScheme.batch_cost(topology.n_column, block_size, args.negatives, element_size=4)
    else:
        predicted = 2 * exchange_cost(
            args.exchange,
            n,
            last - first,
            args.negatives,
            entity_width,
            query_width(loop.scorer, loop.model, loop.tables),
            element_size=4,
            shared_negatives=loop.config.sampler.shares_negatives,
        )
    predicted_replica = replica_cost(
        n,
        topology.replicas,
        last - first,
        args.negatives,
        entity_width,
        loop.sharding.shard_size,
        element_size=4,
        shared_negatives=loop.config.sampler.shares_negatives,
    )
    result = dict(
        rank=loop.topology.rank,
        seconds=seconds,
        triples=factory.num_triples,
        steps=steps,
        bytes_per_step=getattr(topology, "bytes_sent", 0) / steps,
        predicted_bytes_per_step=predicted,
        replica_bytes_per_step=getattr(topology, "replica_bytes_sent", 0) / steps,
        predicted_replica_bytes_per_step=predicted_replica,
        peak_rss=_peak_rss(),
    )
    (args.rank_output / f"rank{result['rank']}.json").write_text(json.dumps(result))


def launch(
    args: argparse.Namespace,
    shards: int,
    replicas: int,
    exchange: str,
    output: pathlib.Path,
    tree: pathlib.Path | None = None,
) -> list[dict]:
    """Run one configuration with one process per rank (the shared harness); return the ranks' measurements.

    :param tree: a checkout whose ``pykeen_bess`` the ranks import (``--baseline``), or None: this one's
    """
    from pykeen_bess.distributed import harness

    world_size = shards * replicas
    command = [__file__, "--worker", "--data", str(args.data), "--rank-output", str(output), "--exchange", exchange]
    command += ["--world-size", str(world_size), "--shards", str(shards), "--replicas", str(replicas)]
    command += ["--backend", args.backend, "--dim", str(args.dim)]
    command += ["--negatives", str(args.negatives), "--batch-size", str(args.batch_size)]
    command += ["--dense-updates"] if args.dense_updates else []
    threads = max(1, args.cores // world_size)
    command += ["--threads", str(threads)] + (["--timing-only"] if tree is not None else [])
    env = None if tree is None else dict(PYTHONPATH=str(tree))
    results = harness.launch(world_size, command, timeout=3600, collective_timeout=600, threads=threads, env=env)
    if not results.ok:
        raise RuntimeError(f"a rank of {shards}x{replicas} {exchange} failed:\n{results.report()}")
    return [json.loads((output / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def step_ab(args: argparse.Namespace, layouts: list[tuple[int, int]]) -> list[dict]:
    """This tree's training step against a baseline checkout's (``--baseline``), per layout and exchange, A B A B.

    Each run is one epoch per rank, as the table's runs; the ranks of the baseline import ``pykeen_bess`` from
    ``--baseline`` (e.g. a checkout of the commit before a change), those of this tree from this checkout.
    """
    here = pathlib.Path(__file__).resolve().parent.parent
    settings = [
        (s, r, e) for s, r in layouts for e in args.exchanges if not (e in COLUMN_SCHEMES and (r > 1 or s == 1))
    ]
    throughput: dict[tuple[int, int, str], dict[str, list[float]]] = {
        setting: {"baseline": [], "this": []} for setting in settings
    }
    for _ in range(args.ab_runs):
        for (shards, replicas, exchange), measured in throughput.items():
            for which, tree in (("baseline", args.baseline.resolve()), ("this", here)):
                with tempfile.TemporaryDirectory() as directory:
                    results = launch(args, shards, replicas, exchange, pathlib.Path(directory), tree=tree)
                measured[which].append(results[0]["triples"] / max(r["seconds"] for r in results))
    baseline = commit(args.baseline) or str(args.baseline)
    rows = []
    for (shards, replicas, exchange), measured in throughput.items():
        columns = paired_columns(measured["baseline"], measured["this"], "triples_per_s")
        rows.append(dict(layout=f"{shards} x {replicas}", exchange=exchange, baseline=baseline, **columns))
        print(rows[-1], flush=True)
    return rows


def skewed_graph(spec: str, directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write a graph ``ENTITIES:RELATIONS:TRIPLES`` with Zipf-skewed degrees as ``train.txt``; return its folder."""
    import numpy as np

    num_entities, num_relations, num_triples = (int(x) for x in spec.split(":"))
    generator = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_entities + 1) ** 1.1
    weights /= weights.sum()
    popular = generator.permutation(num_entities)  # which entities are the hubs
    heads = popular[generator.choice(num_entities, size=num_triples, p=weights)]
    tails = popular[generator.choice(num_entities, size=num_triples, p=weights)]
    relations = generator.integers(num_relations, size=num_triples)
    triples = np.unique(np.stack([heads, relations, tails], axis=1), axis=0)
    lines = (f"e{h}\tr{r}\te{t}" for h, r, t in triples)
    (directory / "train.txt").write_text("\n".join(lines) + "\n")
    return directory


def main() -> None:
    """Run all configurations and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, required=True, help="the WN18RR directory")
    parser.add_argument(
        "--skewed", help="also a generated graph ENTITIES:RELATIONS:TRIPLES with skewed degrees (e.g. 40000:50:300000)"
    )
    parser.add_argument(
        "--exchanges", nargs="+", default=["embedding", "score", "encoding"], help="the schemes to compare"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=["1x1", "2x1", "4x1", "2x2", "1x4"], help="SHARDSxREPLICAS per run"
    )
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--negatives", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument(
        "--dense-updates", action="store_true", help="update the tables densely (sparse_updates=False), every run"
    )
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads shared by the ranks")
    parser.add_argument("--output", type=pathlib.Path, help="write the table as a result file (JSON)")
    parser.add_argument(
        "--baseline",
        type=pathlib.Path,
        help="a checkout of another commit: time its ranks against this tree's instead (A B A B, --ab-runs pairs)",
    )
    parser.add_argument("--ab-runs", type=int, default=3, help="pairs of --baseline runs per layout and exchange")
    # worker mode (internal)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-output", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--exchange", default="embedding", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    layouts = [tuple(int(x) for x in layout.lower().split("x")) for layout in args.layouts]
    if args.backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        too_big = [f"{s}x{r}" for s, r in layouts if s * r > gpus]
        if too_big:
            parser.error(
                f"--backend nccl runs one rank per CUDA GPU: layouts {too_big} need more than the {gpus} GPUs here"
            )
    if args.baseline is not None:
        rows = step_ab(args, layouts)
        if args.output is not None:
            configuration = (
                f"one epoch of DistMult d{args.dim} on {args.data.name}, {args.negatives} negatives, Adam, global "
                f"batch {args.batch_size}, each run the ranks' default step; this tree's against {args.baseline}'s"
            )
            device = f"CPU, {args.backend} over loopback, one process per rank, the ranks share {args.cores} threads"
            tables = [dict(title="the ranks' training step of this tree against the baseline's", rows=rows)]
            write_result(args.output, "distributed-step-ab", "benchmarks/distributed.py", tables, configuration, device)
        return
    rows = []
    with tempfile.TemporaryDirectory() as generated:
        graphs = [("WN18RR" if args.data.name.lower() == "wn18rr" else args.data.name, args.data)]
        if args.skewed:
            graphs.append((f"skewed {args.skewed}", skewed_graph(args.skewed, pathlib.Path(generated))))
        for graph, data in graphs:
            args.data = data
            for shards, replicas in layouts:
                for exchange in args.exchanges:
                    if exchange in COLUMN_SCHEMES and (replicas > 1 or shards == 1):
                        continue  # one column part per rank, no replicas; 1 x 1 is the token run
                    with tempfile.TemporaryDirectory() as directory:
                        results = launch(args, shards, replicas, exchange, pathlib.Path(directory))
                    seconds = max(r["seconds"] for r in results)
                    rows.append(
                        dict(
                            graph=graph,
                            layout=f"{shards} x {replicas}",
                            exchange=exchange,
                            steps=results[0]["steps"],
                            throughput=results[0]["triples"] / seconds,
                            bytes=sum(r["bytes_per_step"] for r in results) / len(results),
                            predicted=results[0]["predicted_bytes_per_step"],
                            replica_bytes=sum(r["replica_bytes_per_step"] for r in results) / len(results),
                            replica_predicted=results[0]["predicted_replica_bytes_per_step"],
                            peak=max(r["peak_rss"] for r in results) / 2**20,
                        )
                    )
                    print(rows[-1], flush=True)
    print()
    print(
        f"| graph | shards (parts) x replicas ({args.backend}) | exchange | steps | triples/s | bytes per step and "
        "rank (measured) | cost model | replica bytes per step and rank (measured) | cost model (at most) | peak "
        "RSS per rank (MiB) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['graph']} | {row['layout']} | {row['exchange']} | {row['steps']} | {row['throughput']:,.0f} | "
            f"{row['bytes']:,.0f} | {row['predicted']:,.0f} | {row['replica_bytes']:,.0f} | "
            f"{row['replica_predicted']:,.0f} | {row['peak']:,.0f} |"
        )
    if args.output is not None:
        write_results(args, layouts, rows)


def write_results(args: argparse.Namespace, layouts: list[tuple[int, int]], rows: list[dict]) -> None:
    """Write the rows as a result file (:mod:`result_files`): one table per graph, the page's column names."""
    keys = (
        ("graph", "graph"),
        ("layout", "layout"),
        ("exchange", "exchange"),
        ("steps", "steps"),
        ("throughput", "triples_per_s"),
        ("bytes", "bytes_per_step"),
        ("predicted", "bytes_cost_model"),
        ("replica_bytes", "replica_bytes_per_step"),
        ("replica_predicted", "replica_cost_model_at_most"),
        ("peak", "peak_rss_mib"),
    )
    tables = [
        dict(
            title=f"{graph}, layouts {', '.join(f'{s} x {r}' for s, r in layouts)}",
            rows=[{name: row[key] for key, name in keys} for row in rows if row["graph"] == graph],
        )
        for graph in dict.fromkeys(row["graph"] for row in rows)
    ]
    configuration = (
        f"one epoch of DistMult d{args.dim} (no entity constraint or regularizer), {args.negatives} negatives, Adam, "
        f"global batch {args.batch_size}; layout = shards (parts) x replicas; exchanges {', '.join(args.exchanges)}"
        + (
            f"; the skewed graph {args.skewed} (ENTITIES:RELATIONS:TRIPLES drawn) has Zipf degrees"
            if args.skewed
            else ""
        )
    )
    device = (
        f"CPU, {args.backend} over loopback, one process per rank, the ranks share {args.cores} threads"
        if args.backend == "gloo"
        else "one CUDA GPU per rank, nccl"
    )
    write_result(
        args.output, "distributed", "benchmarks/distributed.py", tables, configuration, device, backend=args.backend
    )


if __name__ == "__main__":
    main()
