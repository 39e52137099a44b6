"""The result files of the benchmarks: what ``--output FILE.json`` writes, as the benchmarks page reads it.

Every script that computes results takes ``--output FILE.json`` and writes its table(s) with
:func:`write_result`: a JSON object with the header

* ``benchmark``, ``script``: which benchmark and which script wrote it;
* ``date`` (today), ``commit`` (``git rev-parse --short HEAD`` of this checkout, None outside git),
  ``machine`` (host name, architecture and CPU count), ``device`` (the compute device, as
  :func:`devices.describe` names it, where the script has one), ``command`` (the command line) and
  ``configuration`` (the settings, in words);

and then either ``tables`` (a list of ``{"title": ..., "rows": [...]}``, optionally with more keys
such as ``command`` or ``summary``) or ``rows`` (one table). ``docs/render_benchmarks.py`` renders
``benchmarks/results/*.json`` into the docs' benchmarks page: the rows' keys are the ones its
renderer for the benchmark reads.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["commit", "command_line", "header", "machine", "paired_columns", "write_result"]

HERE = pathlib.Path(__file__).resolve().parent


def commit(checkout: str | os.PathLike[str] = HERE) -> str | None:
    """A checkout's short commit hash (default: this one's), or None (no git, or not a git checkout)."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=checkout, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def paired_columns(baseline: Sequence[float], this: Sequence[float], unit: str) -> dict[str, Any]:
    """The columns of an A/B comparison (``--baseline``): both medians, the pairs' ratios (this / baseline).

    :param baseline: the baseline's measurements, in the order of the pairs
    :param this: this checkout's, in the same order
    :param unit: the measurements' name in the columns (``"positives_per_s"``)
    """
    ratios = [mine / theirs for mine, theirs in zip(this, baseline)]
    return {
        f"baseline_{unit}": statistics.median(baseline),
        f"this_{unit}": statistics.median(this),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "pairs": len(ratios),
    }


def machine() -> str:
    """The host's name, architecture, CPU model (where Linux names it) and CPU count.

    The model matters for ratios to the machine's own matmul rate: on a 2-core "AMD EPYC" VM one
    evaluation-sized product took about 3x as long as on the 2-core VM of earlier result files, an
    evaluation about 2x.
    """
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            model = next((line.split(":", 1)[1].strip() for line in file if line.startswith("model name")), "")
    except OSError:
        pass
    details = ", ".join(part for part in (platform.machine(), model, f"{os.cpu_count()} CPUs") if part)
    return f"{platform.node()} ({details})"


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that ran ``script`` (``python benchmarks/NAME.py ARGS``; default: this process's arguments)."""
    arguments = sys.argv[1:] if argv is None else argv
    return " ".join(["python", script, *(shlex.quote(argument) for argument in arguments)])


def header(benchmark: str, script: str, configuration: str, device: str | None = None) -> dict[str, Any]:
    """The header fields of a result file."""
    return dict(
        benchmark=benchmark,
        script=script,
        date=datetime.date.today().isoformat(),
        commit=commit(),
        machine=machine(),
        device=device,
        command=command_line(script),
        configuration=configuration,
    )


def is_tables(content: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``content`` is a list of tables (each with ``title`` and ``rows``) rather than rows."""
    return bool(content) and all("title" in part and "rows" in part for part in content)


def write_result(
    path: str | os.PathLike[str],
    benchmark: str,
    script: str,
    rows_or_tables: Sequence[Mapping[str, Any]],
    configuration: str,
    device: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Write a result file: the header, any ``extra`` top-level fields, and the tables or rows; return it.

    :param path: the JSON file (its folder is created)
    :param benchmark: the benchmark's name (e.g. ``"quality"``)
    :param script: the script, relative to the repository (``"benchmarks/quality.py"``)
    :param rows_or_tables: a list of tables (dicts with ``title`` and ``rows``), written as
        ``tables``, or a list of rows, written as ``rows``
    :param configuration: the settings of the run, in words
    :param device: the compute device (:func:`devices.describe`), where the script has one
    """
    result = header(benchmark, script, configuration, device)
    result.update(extra)
    result["tables" if is_tables(rows_or_tables) else "rows"] = [dict(part) for part in rows_or_tables]
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return result
