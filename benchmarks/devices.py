"""The compute device of a benchmark: the ``--device`` flag, and what timing and memory need on it.

The benchmarks that take ``--device`` (see the benchmarks page) accept ``auto`` (the default: the current
CUDA device when torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:INDEX``. A CUDA device
that torch cannot use is an error before any work starts: PyKEEN itself would fall back to the
CPU with a warning, and the table would then report CPU figures under a GPU's name.

CUDA kernels run asynchronously, so a clock read after a step measures the launch, not the work:
:func:`synchronize` waits for the device before every clock read of a timed region.
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["CLI_HOST_SETTINGS", "add_device_argument", "describe", "parse_device", "synchronize"]

#: the process settings the command line gives BESS's loop and evaluator (the Python API leaves both
#: alone unless asked): intra-op threads measured, glibc keeping freed memory (both only on the CPU)
CLI_HOST_SETTINGS = dict(num_threads="auto", host_allocator="auto")


def parse_device(text: str) -> torch.device:
    """Return the device ``text`` names (``auto``, ``cpu``, ``cuda``, ``cuda:INDEX``); fail if torch cannot use it."""
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (auto, cpu, cuda or cuda:INDEX)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"the benchmarks run on the CPU or on CUDA, not on {device.type!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device {text}: this torch build or machine has no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"--device {text}: there are {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)


def add_device_argument(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """Add ``--device`` to a benchmark's parser; ``args.device`` is a :class:`torch.device`.

    :param default: the device when the flag is not given (None: ``args.device`` is None, for
        scripts whose modes choose their own default)
    """
    parser.add_argument(
        "--device",
        type=parse_device,
        default=default,
        help="the compute device: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:INDEX",
    )


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished its queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """Name the device for a table's heading: the GPU's name, or the CPU with torch's thread count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"CPU, {torch.get_num_threads()} torch threads"
