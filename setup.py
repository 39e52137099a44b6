"""Packaging for pykeen-bess."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="pykeen-bess",
    version="0.1.0",
    description="BESS (Balanced Entity Sampling and Sharing) training and sharded evaluation for PyKEEN",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["pykeen_bess", "pykeen_bess.*"]),
    py_modules=["pykeen_bess_autoload"],
    python_requires=">=3.10",
    install_requires=[
        "pykeen>=1.11,<1.12",
        "torch>=2.1,<3",
        "class-resolver>=0.4.2",
        "numpy>=1.23",
        "scipy",
        "pandas",
        "tqdm",
        "torch-max-mem>=0.1.1",
        # PyTorch-BigGraph's files (pykeen_bess.pbg): HDF5, and fast TSV import
        "h5py>=3.0",
        "pyarrow>=14",
    ],
    extras_require={
        "tests": [
            "pytest",
            "nbformat",
            "nbclient",
            "ipykernel",
            "matplotlib",
            "ruff",
            "mypy",
            # the cross-checks with real PyTorch-BigGraph (tests/pbg); it imports pkg_resources
            "torchbiggraph>=1.0,<1.1",
            "setuptools<81",
        ],
        # the Sphinx site under docs/ (sphinx-build -W -b html docs OUT, as .ci/run builds it)
        "docs": [
            "sphinx>=7.2,<9",
            "myst-parser>=2,<5",
            "sphinx-rtd-theme>=2,<4",
            "matplotlib>=3.7",
        ],
    },
    entry_points={
        # PyKEEN reads only this group; the module installs a post-import hook that registers
        # the plugin once PyKEEN's resolvers exist (see pykeen_bess/registration.py).
        "pykeen.datasets": [
            "pykeen_bess = pykeen_bess_autoload:Nations",
        ],
        "pykeen.training_loops": [
            "bess = pykeen_bess.training:BessTrainingLoop",
        ],
        "pykeen.evaluators": [
            "bess = pykeen_bess.evaluation:BessEvaluator",
        ],
        "pykeen.interactions": [
            "interht = pykeen_bess.nn.interactions:InterHTInteraction",
            "trans = pykeen_bess.nn.interactions:TranSInteraction",
        ],
        "pykeen.models": [
            "interht = pykeen_bess.nn.models:InterHT",
            "trans = pykeen_bess.nn.models:TranS",
        ],
        "pykeen.optimizers": [
            "rowwise_adagrad = pykeen_bess.tables.optim:RowwiseAdagrad",
        ],
        "pykeen.losses": [
            "weightednssa = pykeen_bess.nn.loss:WeightedNSSALoss",
        ],
        "pykeen.loss_weighters": [
            "subsampling = pykeen_bess.nn.loss:SubsamplingLossWeighter",
        ],
        "console_scripts": [
            "pykeen-bess = pykeen_bess.cli:main",
        ],
    },
)
