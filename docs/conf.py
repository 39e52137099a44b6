"""Sphinx configuration of the pykeen-bess documentation (``sphinx-build -W -b html docs OUT``).

No network: no intersphinx. The benchmarks page's tables and plots and the explanation's figure
are generated at build time into ``docs/_generated/`` (git-ignored) by ``render_benchmarks.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS))

import render_benchmarks  # noqa: E402

render_benchmarks.render(ROOT / "benchmarks" / "results", DOCS / "_generated")

project = "pykeen-bess"
author = "the pykeen-bess authors"
copyright = "the pykeen-bess authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "bess_docs",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "_generated/*.md"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_inherit_docstrings = False
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = False

html_theme = "sphinx_rtd_theme"
html_title = "pykeen-bess"
html_static_path = ["_static"]
html_css_files = ["bess.css"]  # wide tables wrap within the page
# "--flag" stays two hyphens (a user copies it); quotes and ellipses are still typeset
smartquotes_action = "qe"
