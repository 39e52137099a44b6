"""The package is MIT-licensed, like PyKEEN and BESS-KGE: a LICENSE file, the installed metadata, the README."""

from __future__ import annotations

import importlib.metadata
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def test_the_license_file_is_mit() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "Copyright (c) 2026 the pykeen-bess authors" in text


def test_the_installed_metadata_declares_mit() -> None:
    metadata = importlib.metadata.metadata("pykeen-bess")
    assert metadata["License"] == "MIT"
    assert "License :: OSI Approved :: MIT License" in metadata.get_all("Classifier", [])
    assert "LICENSE" in metadata.get_all("License-File", [])


def test_the_readme_names_the_license() -> None:
    assert (
        (ROOT / "README.md")
        .read_text(encoding="utf-8")
        .rstrip()
        .endswith("License: MIT, like PyKEEN and BESS-KGE ([LICENSE](LICENSE)).")
    )
