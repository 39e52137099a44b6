"""Every code block of the docs runs as written, as the README's do (``tests/test_readme.py``).

Each Markdown page's ```python blocks and the single-process ``python -m pykeen_bess train`` lines of
its ```bash blocks run in order in one temporary directory per page, so a block may use the files an
earlier block of its page wrote; each runs as a fresh interpreter would, in a child forked from one
that has imported PyKEEN and the plugin (the README's blocks run in fresh interpreters). Blocks the README has
too run there only. ``torchrun`` lines are run by ``tests/distributed`` and the ``pbg`` commands by
``tests/pbg``, not here.
"""

from __future__ import annotations

import pathlib
import re
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


def snippet_step(kind: str, code: str, cwd: pathlib.Path) -> dict[str, object]:
    """A snippet as a step of :mod:`forked_programs`: Python code, or ``python -m ...`` with ``--quiet``."""
    if kind == "python":
        return dict(code=code, cwd=str(cwd))
    module, *arguments = code.split()[2:]  # "python -m MODULE ARGUMENTS"
    return dict(module=module, argv=[*arguments, "--quiet"], cwd=str(cwd))


@pytest.fixture(scope="module")
def page_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every page's snippets, run in order in one folder per page, each page beside the others.

    Each snippet runs in a child forked from an interpreter that has imported PyKEEN and the plugin
    (:mod:`forked_programs`): a fresh interpreter's start, not the snippet, was most of its time.
    """
    from forked_programs import run_chains

    pages = [page for page, found in PAGES.items() if found]
    chains = []
    for page in pages:
        folder = tmp_path_factory.mktemp(page.replace("/", "-").removesuffix(".md"))
        chains.append([snippet_step(kind, code, folder) for kind, code in PAGES[page]])
    return dict(zip(pages, run_chains(chains, preload="plugin", OMP_NUM_THREADS="1")))


@pytest.mark.parametrize("page", [page for page, found in PAGES.items() if found])
def test_page_snippets(page: str, page_outcomes: dict[str, list[dict]]) -> None:
    for index, ((kind, code), outcome) in enumerate(zip(PAGES[page], page_outcomes[page], strict=True)):
        assert outcome["status"] == 0, f"{page}, snippet {index}:\n{code}\n{outcome['stderr'][-3000:]}"
        if kind == "command":
            assert "MRR" in outcome["stdout"], f"{page}, snippet {index}: {code}\n{outcome['stdout'][-2000:]}"


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


def test_the_cli_reference_keeps_flags_and_metrics_literal() -> None:
    """Option texts show ``--flag`` as typed (not an en dash) and ``hits@10`` as a metric (not an e-mail link)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import bess_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    from pykeen_bess.cli import build_parser

    assert bess_docs.help_cell("a multiple of --num-shards (see --storage-path)") == (
        "a multiple of ``--num-shards`` (see ``--storage-path``)"
    )
    assert bess_docs.help_cell("the validation metric, hits@10") == "the validation metric, ``hits@10``"
    cells = [row for parser in bess_docs.subcommands(build_parser(), "pykeen-bess")[1:]
             for _, rows in bess_docs.option_rows(parser[1]) for row in rows]  # fmt: skip
    texts = " ".join(text for _, _, text in cells)
    assert " --" not in texts.replace(" ``--", "") and "``--num-shards``" in texts
    train = dict(bess_docs.subcommands(build_parser(), "pykeen-bess"))["pykeen-bess train"]
    train_rows = [row for _, rows in bess_docs.option_rows(train) for row in rows]
    defaults = {flags.split(",")[0].split()[0]: default for flags, default, _ in train_rows}
    assert defaults["``--dim``"] == "``64``" and defaults["``--epochs``"] == "``100``"  # from "(default: ...)"
    assert defaults["``--stopper-metric``"] == "``hits@10``"
    conf = (DOCS / "conf.py").read_text()
    assert 'smartquotes_action = "qe"' in conf  # Sphinx would turn the "--" of flags in prose into dashes


def test_the_benchmarks_page_names_no_paths_of_the_recording_machine() -> None:
    """Commands on the page read as a reader runs them: their data directory and files, not the recorder's."""
    sys.path.insert(0, str(DOCS))
    try:
        import render_benchmarks
    finally:
        sys.path.remove(str(DOCS))
    shown = render_benchmarks.shown_command(
        "python benchmarks/training.py --data ../../shared/data/wn18rr --baseline /tmp/base --output /tmp/ab/x.json"
    )
    assert shown == "python benchmarks/training.py --data DATA/wn18rr --baseline BASELINE_CHECKOUT --output FILE.json"
    page = (DOCS / "benchmarks.md").read_text()
    for phrase in ("shared/data", "/tmp/", "this session", "had shown", "transcribed", "by hand"):
        assert phrase not in page, phrase
