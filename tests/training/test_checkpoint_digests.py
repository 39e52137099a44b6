"""A corrupted checkpoint is refused before anything is resumed or written, naming the file (every layout)."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest
import torch
from pykeen.pipeline import pipeline

from pykeen_bess import CorruptCheckpointError
from pykeen_bess.distributed import LocalTopology
from pykeen_bess.storage.digests import crc32_of_array, verify_array, verify_torch_file
from pykeen_bess.training.checkpoints.files import load_verified, read_pointer, save_distributed_checkpoint


def run(directory: pathlib.Path, epochs: int, storage: str = "device", **loop_kwargs):
    """The issue's call: Nations, two logical shards, one checkpoint file."""
    if "storage_path" in loop_kwargs:
        loop_kwargs["storage_path"].mkdir(exist_ok=True)
    return pipeline(
        dataset="nations",
        model="DistMult",
        model_kwargs=dict(embedding_dim=16),
        training_loop="bess",
        training_loop_kwargs=dict(num_shards=2, storage=storage, **loop_kwargs),
        optimizer="adam",
        training_kwargs=dict(
            num_epochs=epochs,
            batch_size=128,
            use_tqdm=False,
            checkpoint_directory=directory,
            checkpoint_name="c.pt",
            checkpoint_frequency=0,
        ),
        evaluator="bess",
        evaluation_kwargs=dict(use_tqdm=False),
        random_seed=1,
    )


def flip(file: pathlib.Path, offset: int | None = None, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``file`` (or at ``offset``)."""
    data = bytearray(file.read_bytes())
    start = len(data) // 2 if offset is None else offset
    data[start : start + count] = bytes(255 - b for b in data[start : start + count])
    file.write_bytes(bytes(data))


def digest_of(directory: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_a_flipped_torch_record_is_found_and_named(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "state.pt"
    torch.save({"table": torch.randn(2000, 32), "epoch": 3}, file)
    verify_torch_file(file)  # as written
    flip(file)
    assert torch.load(file, weights_only=False)["epoch"] == 3  # torch.load does not notice
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt is corrupted: its record '.*data/0'"):
        verify_torch_file(file)


def test_a_truncated_or_empty_torch_file_is_refused_and_named(tmp_path: pathlib.Path) -> None:
    """A copy cut short has lost the archive's directory (torch fails with an unnamed OSError): refused by name."""
    file = tmp_path / "state.pt"
    torch.save({"table": torch.randn(500, 8), "epoch": 3}, file)
    data = file.read_bytes()
    for size in (len(data) - 10, len(data) // 2, 1000, 0):
        file.write_bytes(data[:size])
        state = "empty" if size == 0 else "truncated"
        with pytest.raises(CorruptCheckpointError, match=rf"state\.pt is {state}"):
            verify_torch_file(file)
        with pytest.raises(CorruptCheckpointError, match=rf"state\.pt is {state}"):
            load_verified(file)
    legacy = tmp_path / "legacy.pt"  # torch's legacy format is no zip archive: left to torch.load
    torch.save({"epoch": 3}, legacy, _use_new_zipfile_serialization=False)
    verify_torch_file(legacy)
    assert load_verified(legacy)["epoch"] == 3


def test_array_digests_see_a_single_changed_value() -> None:
    values = np.random.default_rng(0).standard_normal((300, 7)).astype(np.float32)
    digest = crc32_of_array(values)
    assert digest == crc32_of_array(torch.from_numpy(values))
    verify_array(values, digest, "file")
    values[123, 4] = np.nextafter(values[123, 4], np.float32(2))
    with pytest.raises(CorruptCheckpointError, match="file is corrupted"):
        verify_array(values, digest, "file")


@pytest.mark.parametrize("storage", ["device", "host", "mmap"])
def test_pipeline_refuses_a_corrupted_checkpoint_and_keeps_it(tmp_path: pathlib.Path, storage: str) -> None:
    """The issue's case: 64 bytes flipped in the middle of the checkpoint; rerunning the call changes nothing."""
    kwargs = dict(storage_path=tmp_path / "tables") if storage == "mmap" else {}
    directory = tmp_path / "run"
    run(directory, epochs=2, storage=storage, **kwargs)
    flip(directory / "c.pt")
    before = digest_of(directory)
    # a flipped header is found by PyKEEN's own read of the random seed, before the loop exists (torch's
    # error); flipped values (the tables of the device and host tiers fill the middle) by the digests
    expected = CorruptCheckpointError if storage != "mmap" else (CorruptCheckpointError, RuntimeError)
    with pytest.raises(expected, match=r"corrupted") as error:
        run(directory, epochs=4, storage=storage, **kwargs)
    if error.type is CorruptCheckpointError:
        assert "c.pt is corrupted" in str(error.value) and "Nothing was resumed or written" in str(error.value)
    assert digest_of(directory) == before


def test_a_corrupted_copy_of_a_table_in_files_is_refused(tmp_path: pathlib.Path) -> None:
    kwargs = dict(storage="mmap", storage_path=tmp_path / "tables")
    run(tmp_path / "run", epochs=2, **kwargs)
    copies = sorted((tmp_path / "run").glob("c.pt.tables-*/*.npy"))
    assert copies
    flip(copies[0], offset=copies[0].stat().st_size - 100, count=4)  # a value, not the header
    before = digest_of(tmp_path / "run")
    with pytest.raises(CorruptCheckpointError, match=rf"{copies[0].name} is corrupted"):
        run(tmp_path / "run", epochs=4, **kwargs)
    assert digest_of(tmp_path / "run") == before


def test_a_corrupted_rank_file_or_pointer_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run.pt"

    def write(file: pathlib.Path) -> None:
        torch.save({"epoch": 1, "table": torch.randn(500, 8)}, file)

    save_distributed_checkpoint(path, LocalTopology(1), write, epoch=1, seed=0)
    from pykeen_bess.training.checkpoints.files import load_verified

    rank_file = tmp_path / "run.pt.v1.rank0-of-1"
    assert load_verified(rank_file)["epoch"] == 1
    flip(rank_file)
    with pytest.raises(CorruptCheckpointError, match="rank0-of-1 is corrupted"):
        load_verified(rank_file)
    zip_offset = path.read_bytes().find(b"pykeen-bess-distributed")  # the pickled pointer
    flip(path, offset=zip_offset, count=4)
    with pytest.raises(CorruptCheckpointError, match=r"run\.pt is corrupted"):
        read_pointer(path)


def test_checkpoints_are_written_with_digests_even_if_torch_was_told_not_to(tmp_path: pathlib.Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        save_distributed_checkpoint(
            tmp_path / "run.pt", LocalTopology(1), lambda file: torch.save({"t": torch.ones(9)}, file), epoch=1, seed=0
        )
    finally:
        torch.serialization.set_crc32_options(True)
    import zipfile

    for file in tmp_path.iterdir():
        assert all(record.CRC for record in zipfile.ZipFile(file).infolist() if record.file_size), file.name
