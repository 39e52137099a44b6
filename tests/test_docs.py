"""Every code block of the docs runs as written, as the README's do (``tests/test_readme.py``).

Each Markdown page's ```python blocks (each in a fresh interpreter) and the single-process
``python -m pykeen_bess train`` lines of its ```bash blocks run in order in one temporary directory
per page, so a block may use the files an earlier block of its page wrote. Blocks the README has
too run there only. ``torchrun`` lines are run by ``tests/distributed`` and the ``pbg`` commands by
``tests/pbg``, not here.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # fresh interpreters / subprocesses

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def snippets(text: str) -> list[tuple[str, str]]:
    """A page's runnable snippets in order: ("python", code) and ("command", command line)."""
    found = []
    for language, block in re.findall(r"```(python|bash)\n(.*?)```", text, flags=re.DOTALL):
        if language == "python":
            found.append(("python", block))
            continue
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("#")[0].split("&&"):
                if command.strip().startswith("python -m pykeen_bess train"):
                    found.append(("command", " ".join(command.split())))
    return found


IN_README = set(snippets(README.read_text(encoding="utf-8")))
PAGES = {
    str(path.relative_to(DOCS)): [s for s in snippets(path.read_text(encoding="utf-8")) if s not in IN_README]
    for path in sorted(DOCS.rglob("*.md"))
    if "_generated" not in path.parts and "_build" not in path.parts
}


def test_the_docs_have_snippets() -> None:
    total = sum(len(page) for page in PAGES.values())
    assert total >= 8, PAGES.keys()
    # the guides that promise code have it
    for page in ("howto/own-graph.md", "howto/evaluation.md", "howto/storage.md", "howto/pbg.md", "howto/hpo.md"):
        assert PAGES[page], page


def run_snippet(kind: str, code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    if kind == "python":
        arguments = [sys.executable, "-c", code]
    else:
        arguments = [sys.executable, *code.split()[1:], "--quiet"]
    return subprocess.run(
        arguments,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


@pytest.mark.parametrize("page", [page for page, found in PAGES.items() if found])
def test_page_snippets(page: str, tmp_path: pathlib.Path) -> None:
    for index, (kind, code) in enumerate(PAGES[page]):
        result = run_snippet(kind, code, tmp_path)
        assert result.returncode == 0, f"{page}, snippet {index}:\n{code}\n{result.stderr[-3000:]}"
        if kind == "command":
            assert "MRR" in result.stdout, f"{page}, snippet {index}: {code}\n{result.stdout[-2000:]}"


def test_missing_result_files_give_a_note(tmp_path: pathlib.Path) -> None:
    """The benchmarks page renders without result files: each benchmark says which file is missing."""
    sys.path.insert(0, str(DOCS))
    try:
        import render_benchmarks
    finally:
        sys.path.remove(str(DOCS))
    (tmp_path / "results").mkdir()
    render_benchmarks.render(tmp_path / "results", tmp_path / "out")
    for name, (filename, _, _) in render_benchmarks.RENDERERS.items():
        text = (tmp_path / "out" / f"{name}.md").read_text()
        assert f"No result file `benchmarks/results/{filename}`" in text
    assert (tmp_path / "out" / "bess-blocks.svg").exists()
