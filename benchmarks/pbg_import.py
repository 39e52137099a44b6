"""Importing a large graph: label TSV and PyTorch-BigGraph files, against PyKEEN's ``TriplesFactory.from_path``.

A skewed graph of ogbl-wikikg2's size (``--entities`` 2,500,000, ``--relations`` 500, ``--triples``
17,000,000 drawn, duplicates removed; ``benchmarks/scale.py``'s generator) is written as a label TSV
file (``Q<id>``, ``P<id>``). Each contender then runs in a fresh process (so peak memory is its own):

* ``pykeen``: PyKEEN's ``TriplesFactory.from_path(file)``;
* ``import_tsv``: ``pykeen_bess.pbg.import_tsv(file)`` (Arrow's CSV reader, vectorised factorisation);
* ``write``: the same import, then ``pbg.write`` of the PyTorch-BigGraph input directory (``--partitions``);
* ``read``: ``pbg.read`` of that directory (entity counts and names, bucket files in chunks).

The table gives the wall time, the peak resident memory (the kernel's high-water mark) and the
increase over the process after its imports, per triple. ``--skip-pykeen`` leaves PyKEEN out (it
takes minutes at full size). It has no ``--device``: reading and writing files is host work.

``--output FILE.json`` writes the table as the benchmarks page reads it (:mod:`result_files`).

    python benchmarks/pbg_import.py --workdir /tmp/pbg-import
    python benchmarks/pbg_import.py --workdir /tmp/pbg-import --entities 250000 --triples 1700000   # smaller
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

from result_files import write_result

HERE = pathlib.Path(__file__).parent


def peak_bytes() -> int:
    """The process's peak resident memory (the kernel's high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_tsv(path: pathlib.Path, entities: int, relations: int, triples: int, seed: int) -> int:
    """Generate the graph and write it as labels; return the number of triples."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as csv

    sys.path.insert(0, str(HERE))
    from scale import generate

    mapped = generate(entities, relations, triples, seed=seed).numpy()
    columns = [
        pc.binary_join_element_wise(prefix, pc.cast(pa.array(mapped[:, i]), pa.string()), "")
        for i, prefix in enumerate(("Q", "P", "Q"))
    ]
    table = pa.table(dict(zip(("head", "relation", "tail"), columns)))
    options = csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    csv.write_csv(table, path, write_options=options)
    return int(mapped.shape[0])


def contender(name: str, path: pathlib.Path, directory: pathlib.Path, partitions: int) -> dict:
    """Run one contender in this (fresh) process; return its measurements."""
    if name == "pykeen":
        from pykeen.triples import TriplesFactory
    else:
        from pykeen_bess import pbg
    base = resident_bytes()
    start = time.perf_counter()
    if name == "pykeen":
        factory = TriplesFactory.from_path(path)
        result = dict(entities=factory.num_entities, relations=factory.num_relations, triples=factory.num_triples)
    elif name in ("import_tsv", "write"):
        graph = pbg.import_tsv(path)
        if name == "write":
            pbg.write(graph.repartition(partitions) if partitions > 1 else graph, directory)
        factory = graph.training
        result = dict(entities=factory.num_entities, relations=factory.num_relations, triples=factory.num_triples)
    else:
        graph = pbg.read(
            directory,
            config=dict(
                entities={"entity": {"num_partitions": partitions}},
                relations=[{"name": "all_edges", "lhs": "entity", "rhs": "entity"}],
                dynamic_relations=True,
                dimension=1,
                entity_path=str(directory),
                edge_paths=[str(directory / "training")],
                checkpoint_path=str(directory / "checkpoints"),
            ),
        )
        factory = graph.training
        result = dict(entities=factory.num_entities, relations=factory.num_relations, triples=factory.num_triples)
    result.update(seconds=time.perf_counter() - start, peak=peak_bytes(), base=base)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=pathlib.Path, required=True, help="where the TSV and PBG files go")
    parser.add_argument("--entities", type=int, default=2_500_000)
    parser.add_argument("--relations", type=int, default=500)
    parser.add_argument("--triples", type=int, default=17_000_000, help="drawn before removing duplicates")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the written PBG directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-pykeen", action="store_true")
    parser.add_argument("--output", type=pathlib.Path, help="write the table as a result file (JSON)")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tsv = args.workdir / f"graph-{args.entities}-{args.relations}-{args.triples}.tsv"
    directory = args.workdir / "pbg"
    if args.contender:  # a child process
        print(json.dumps(contender(args.contender, tsv, directory, args.partitions)))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not tsv.is_file():
        start = time.perf_counter()
        count = write_tsv(tsv, args.entities, args.relations, args.triples, args.seed)
        seconds = time.perf_counter() - start
        print(f"wrote {count:,} triples to {tsv} ({tsv.stat().st_size / 2**20:,.0f} MiB) in {seconds:.0f} s")
    names = ["import_tsv", "write", "read"] + ([] if args.skip_pykeen else ["pykeen"])
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--workdir", str(args.workdir), "--contender", name]
        command += ["--entities", str(args.entities), "--relations", str(args.relations)]
        command += ["--triples", str(args.triples), "--partitions", str(args.partitions)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        result = json.loads(output)
        rows.append((name, result))
        print(f"{name}: {result['seconds']:.1f} s, peak {result['peak'] / 2**30:.2f} GiB", flush=True)
    size = tsv.stat().st_size
    print(f"\nfile: {size / 2**20:,.0f} MiB, {rows[0][1]['triples']:,} triples, {rows[0][1]['entities']:,} entities\n")
    labels = {
        "pykeen": "PyKEEN TriplesFactory.from_path (label TSV)",
        "import_tsv": "pbg.import_tsv (label TSV)",
        "write": f"pbg.import_tsv + pbg.write (PBG files, {args.partitions} partitions)",
        "read": f"pbg.read (PBG files, {args.partitions} partitions)",
    }
    print(
        "| import | wall time (s) | peak RSS (GiB) | above the process after imports (GiB) | bytes per triple "
        "| x PyKEEN time |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    pykeen = dict(rows).get("pykeen")
    for name, result in rows:
        extra = result["peak"] - result["base"]
        ratio = f"{pykeen['seconds'] / result['seconds']:.1f}x" if pykeen and name != "pykeen" else ""
        print(
            f"| {labels[name]} | {result['seconds']:.1f} | {result['peak'] / 2**30:.2f} | {extra / 2**30:.2f} | "
            f"{extra / result['triples']:.0f} | {ratio} |"
        )
    if args.output is not None:
        configuration = (
            f"a {rows[0][1]['triples']:,}-triple / {rows[0][1]['entities']:,}-entity label TSV ({size / 2**20:,.1f} "
            f"MiB; generated: {args.entities:,} entities, {args.relations} relations, {args.triples:,} triples drawn, "
            f"seed {args.seed}), each import in a fresh process"
        )
        table = dict(title="imports", rows=result_rows(rows, labels))
        write_result(args.output, "PBG import", "benchmarks/pbg_import.py", [table], configuration, "CPU (host work)")


def result_rows(rows: list[tuple[str, dict]], labels: dict[str, str]) -> list[dict]:
    """The rows of the result file (:mod:`result_files`): each contender's time and memory, against PyKEEN's time."""
    pykeen = dict(rows).get("pykeen")
    written = []
    for name, result in rows:
        extra = result["peak"] - result["base"]
        written.append(
            dict(
                importer=labels[name],
                seconds=result["seconds"],
                peak_rss_gib=result["peak"] / 2**30,
                above_imports_gib=extra / 2**30,
                bytes_per_triple=extra / result["triples"],
                speedup_vs_pykeen=pykeen["seconds"] / result["seconds"] if pykeen else None,
            )
        )
    return written


if __name__ == "__main__":
    main()
