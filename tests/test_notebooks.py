"""The notebooks under notebooks/ run from top to bottom."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient


NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors


def test_there_is_a_quickstart_notebook() -> None:
    assert any(path.name == "quickstart.ipynb" for path in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs(path: pathlib.Path) -> None:
    """A reader sees the results without running it (``jupyter execute --inplace`` refreshes them)."""
    code = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    assert code and all(cell.get("execution_count") for cell in code)
    assert not [cell for cell in code if any(out.get("output_type") == "error" for out in cell.get("outputs", []))]
    outputs = [output for cell in code for output in cell.get("outputs", [])]
    assert any(output.get("data", {}).get("image/png") for output in outputs)  # the loss curve
    assert not [output for output in outputs if output.get("name") == "stderr"]  # no local paths, no warnings
