"""Every Python snippet of the README runs as written (each in a fresh interpreter), and so do its
single-process ``python -m pykeen_bess`` command lines (the docs' snippets: ``tests/test_docs.py``)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # fresh interpreters / subprocesses

README = pathlib.Path(__file__).parent.parent / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def command_lines() -> list[str]:
    """The README's ``python -m pykeen_bess ...`` commands (continuation lines joined)."""
    commands = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("#")[0].split("&&"):
                if command.strip().startswith("python -m pykeen_bess"):
                    commands.append(" ".join(command.split()))
    return commands


PYTHON_BLOCKS = blocks("python")
COMMANDS = command_lines()


def test_the_readme_has_snippets() -> None:
    # the pipeline() example and the quick start's training command (the same one .ci/run's users run)
    assert len(PYTHON_BLOCKS) >= 1 and "python -m pykeen_bess train --dataset nations --num-shards 2" in COMMANDS


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_snippet(index: int, tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS[index]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, f"snippet {index}:\n{PYTHON_BLOCKS[index]}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("command", COMMANDS)
def test_command_line(command: str, tmp_path: pathlib.Path) -> None:
    arguments = command.split()[1:]  # without "python"
    result = subprocess.run(
        [sys.executable, *arguments, "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    assert "MRR" in result.stdout
