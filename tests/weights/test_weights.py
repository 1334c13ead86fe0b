"""The weights identity (``hicache_store.weights``) of real safetensors checkpoints.

What must tell weights apart does: a header-only change (a dtype, a shape over the same bytes),
a changed byte that a sample covers, another config. What must not does not: the same files at
another path, with other mtimes or inodes. Hub snapshots are named by their commit.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from _weights import CONFIG, checkpoint

from hicache_store.layout.errors import WeightsError
from hicache_store.weights import (
    SAMPLE_BYTES,
    SAMPLES,
    fingerprint,
    hub_commit,
    sample_ranges,
    weights_identity,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def data_start(file: Path) -> int:
    """Where a safetensors file's tensor bytes begin."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return 8 + length


def flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def ident(folder: Path) -> str:
    found = weights_identity(folder)
    assert found is not None
    return found.value


def test_the_same_files_at_another_path_with_other_mtimes_are_the_same_weights(
        tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a" / "llama")
    b = tmp_path / "elsewhere" / "other-name"
    shutil.copytree(a, b)  # other inodes
    os.utime(b / "model.safetensors", (1, 1))
    os.utime(b / "config.json", (2, 2))
    assert ident(a).startswith("fp-") and len(ident(a)) == 3 + 32
    assert ident(a) == ident(b)
    # a symlink to the folder names the same files
    (tmp_path / "link").symlink_to(a)
    assert ident(tmp_path / "link") == ident(a)


def test_other_weights_under_the_same_name_and_config_differ(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a" / "llama")
    g = torch.Generator().manual_seed(1)
    b = checkpoint(tmp_path / "b" / "llama", {"embed.weight": torch.randn(512, 256, generator=g),
                                              "norm.weight": torch.randn(64, generator=g)})
    assert ident(a) != ident(b)


@pytest.mark.parametrize("change", ["dtype", "shape", "name"])
def test_a_header_only_change_differs(tmp_path: Path, change: str) -> None:
    """The same tensor bytes, described otherwise: only the header differs."""
    raw = torch.arange(64 * 32, dtype=torch.int16).view(torch.float16).reshape(64, 32)
    base = checkpoint(tmp_path / "base", {"w": raw})
    other = {"dtype": {"w": raw.view(torch.bfloat16)},
             "shape": {"w": raw.reshape(32, 64)},
             "name": {"w2": raw}}[change]
    changed = checkpoint(tmp_path / "changed", other)
    # the tensor bytes are equal: only the header tells them apart
    with open(base / "model.safetensors", "rb") as f1, open(changed / "model.safetensors",
                                                            "rb") as f2:
        d1, d2 = f1.read()[data_start(base / "model.safetensors"):], f2.read()[
            data_start(changed / "model.safetensors"):]
    assert d1 == d2
    assert ident(base) != ident(changed)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_changed_sampled_byte_differs(tmp_path: Path, where: str) -> None:
    folder = checkpoint(tmp_path / "m")
    before = ident(folder)
    file = folder / "model.safetensors"
    start, stop = data_start(file), file.stat().st_size
    assert stop - start > SAMPLES * SAMPLE_BYTES  # three samples, not the whole
    offset = {r: o for r, (o, _n) in zip(("start", "middle", "end"),
                                          sample_ranges(start, stop), strict=True)}[where]
    flip(file, offset + 7)
    assert ident(folder) != before


def test_a_byte_no_sample_covers_is_not_seen(tmp_path: Path) -> None:
    """The documented limit: a fingerprint, not a checksum of every byte."""
    folder = checkpoint(tmp_path / "m")
    before = ident(folder)
    file = folder / "model.safetensors"
    start = data_start(file)
    flip(file, start + SAMPLE_BYTES + 100)  # between the first and the middle sample
    assert ident(folder) == before


def test_the_config_and_every_weights_file_count(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "m")
    before = ident(folder)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "rope_theta": 5e5}))
    after_config = ident(folder)
    assert after_config != before
    (folder / "extra.bin").write_bytes(b"\0" * 10)  # a second weights file
    with_extra = ident(folder)
    assert with_extra != after_config
    # files that hold no weights (tokenizer, README) and hidden folders do not count
    (folder / "tokenizer.json").write_text("{}")
    (folder / "README.md").write_text("other weights, same name")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.safetensors").write_bytes(b"junk")
    assert ident(folder) == with_extra
    (folder / "extra.bin").unlink()
    assert ident(folder) == after_config


def test_hub_snapshots_are_named_by_their_commit(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = checkpoint(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    other = "f" * 40
    checkpoint(repo / "snapshots" / other)
    (repo / "refs" / "v2").write_text(other + "\n")
    assert weights_identity(snapshot).value == f"hf-{COMMIT}"  # type: ignore[union-attr]
    assert hub_commit(repo) == COMMIT  # the repo folder: refs/main
    assert hub_commit(repo, "v2") == other
    assert hub_commit(repo, other) == other
    assert hub_commit(repo, "1" * 40) is None  # a commit the cache does not hold
    # a hub id, found in the local hub cache
    found = weights_identity("org/tiny", hub_cache=tmp_path / "hub")
    assert found is not None and found.value == f"hf-{COMMIT}"
    assert weights_identity("org/tiny", "v2", hub_cache=tmp_path / "hub").value == (  # type: ignore[union-attr]
        f"hf-{other}")
    assert weights_identity("org/absent", hub_cache=tmp_path / "hub") is None
    # a copy of a snapshot elsewhere is a plain folder: fingerprinted
    copy = tmp_path / "copy"
    shutil.copytree(snapshot, copy)
    assert ident(copy).startswith("fp-")


def test_nothing_to_identify_is_none(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert weights_identity(tmp_path / "empty") is None  # no weights file
    assert fingerprint(tmp_path / "empty") is None
    assert weights_identity(tmp_path / "missing") is None
    assert weights_identity("not/a-cached-model", hub_cache=tmp_path) is None


@pytest.mark.parametrize("header", [
    struct.pack("<Q", 1 << 40),  # a header longer than the file
    struct.pack("<Q", 4) + b"{{{{",  # not JSON
    b"\x01\x02",  # shorter than the length field
])
def test_a_malformed_safetensors_file_is_a_clear_error(tmp_path: Path, header: bytes) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(header)
    with pytest.raises(WeightsError, match="model.safetensors"):
        weights_identity(folder)


def test_sample_ranges() -> None:
    assert sample_ranges(8, 8) == []
    assert sample_ranges(8, 108) == [(8, 100)]
    span = SAMPLES * SAMPLE_BYTES
    assert sample_ranges(0, span) == [(0, span)]
    big = 10 << 30
    ranges = sample_ranges(100, 100 + big)
    assert ranges == [(100, SAMPLE_BYTES), (100 + (big - SAMPLE_BYTES) // 2, SAMPLE_BYTES),
                      (100 + big - SAMPLE_BYTES, SAMPLE_BYTES)]
