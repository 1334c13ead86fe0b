"""The identity of a model's weights, read from its files: what keeps KV of other weights apart.

Stored KV depends on the weights, not on the model's name: a directory with the same name,
config and tokenizer but other weights computes other KV. The engine integrations and the tools
put ``weights_identity(model)`` in the namespace (as its ``model_revision``, through
``layout.namespace.weights_revision``, where an explicit revision still wins):

* a Hugging Face hub snapshot: ``hf-<commit>``. The directory is a snapshot
  (``.../models--org--name/snapshots/<commit>/``), or a hub repo folder
  (``.../models--org--name``, whose ``refs/<revision>`` file names the commit; ``main`` unless
  ``revision`` is given), or a hub id (``org/name``) found in the local hub cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, or
  ``hub_cache``);
* any other directory: ``fp-<32 hex>``, a sha256 over ``config.json`` and, for every weights
  file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``; subfolders included,
  hidden ones not), its name relative to the directory, its size and ``SAMPLES`` ranges of
  ``SAMPLE_BYTES`` at fixed relative offsets of its tensor bytes; of a safetensors file also
  its header (every tensor's name, dtype, shape and offsets, and the metadata), read alone
  (its length is the file's first 8 bytes). About 200 KiB read per file, whatever its size:
  cheap on 100 GB of weights (BENCHMARKS.md, "Weights identity").

The identity is equal on every host that holds the same files: no absolute path, mtime or
inode enters it, so the same weights copied to another path share stored KV, and a hub
snapshot has the same identity wherever it was downloaded. A change to any header, to the
config or to a sampled byte changes it; a change to a tensor byte that no sample covers does
not (a fingerprint, not a checksum: weights are replaced whole, or saved again, in practice).

``None`` when nothing identifies the weights: a path that does not exist, a hub id that is not
in the local cache, a directory without weights files. ``WeightsError`` for a weights file that
cannot be read or whose safetensors header is out of bounds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from hicache_store.layout.errors import WeightsError

__all__ = [
    "SAMPLES",
    "SAMPLE_BYTES",
    "WEIGHT_SUFFIXES",
    "WeightsIdentity",
    "fingerprint",
    "hub_commit",
    "weights_identity",
]

#: suffixes of the files that hold weights (a fingerprint covers these and ``config.json``).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: byte ranges sampled per weights file, at fixed relative offsets of its tensor bytes.
SAMPLES = 3
SAMPLE_BYTES = 64 << 10
#: the largest safetensors header read (the format's own bound is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: the largest ``config.json`` read whole.
MAX_CONFIG_BYTES = 16 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TAG = b"hicache-store/weights-fingerprint/1"


@dataclass(frozen=True)
class WeightsIdentity:
    """A model's weights identity: ``value`` goes in the namespace, ``how`` says where it came
    from (for logs and ``doctor``)."""

    value: str
    how: str

    def __str__(self) -> str:
        return f"{self.value} ({self.how})"


def revision_source(
    explicit: str | None, identity: WeightsIdentity | None, *, given: str,
    engine_model: str = "the model", unknown: str | None = None,
) -> str:
    """Where a namespace's model revision comes from, in words, by the precedence of
    ``layout.namespace.weights_revision``: a ``model_revision`` set (``given`` says where;
    set empty, none), else the weights' ``identity``, else ``unknown`` (by default: no model
    files at ``engine_model``, where the engine loads them)."""
    if explicit is not None:
        return f"model_revision {explicit!r} {given}" if explicit else (
            "none: model_revision set empty")
    if identity is not None:
        return str(identity)
    if unknown is not None:
        return unknown
    return (f"unknown: no model files found at {engine_model}; set model_revision to tell "
            "other weights apart")


def weights_identity(
    model: str | os.PathLike[str], revision: str | None = None, *, hub_cache: Path | None = None
) -> WeightsIdentity | None:
    """The identity of the weights an engine loads as ``model`` (a directory or a hub id) at
    ``revision`` (a hub branch, tag or commit; ``main`` when None). See the module docstring."""
    path = Path(model)
    if path.is_dir():
        commit = hub_commit(path, revision)
        if commit is not None:
            return WeightsIdentity(f"hf-{commit}", f"Hugging Face snapshot {commit}")
        return fingerprint(path)
    text = str(model)
    if path.exists() or not _looks_like_hub_id(text):
        return None
    repo = (hub_cache or _hub_cache()) / ("models--" + text.replace("/", "--"))
    commit = hub_commit(repo, revision) if repo.is_dir() else None
    if commit is None:
        return None
    return WeightsIdentity(f"hf-{commit}", f"Hugging Face snapshot {commit} of {text}")


def hub_commit(path: Path, revision: str | None = None) -> str | None:
    """The commit of a hub snapshot folder (``.../snapshots/<commit>``, also when reached
    through a link), or of a hub repo folder (``models--org--name``: the ``refs/<revision>``
    file, ``main`` by default, or ``revision`` itself when it is a commit it holds); None
    for any other folder."""
    for candidate in (path, path.resolve()):
        if (_COMMIT.fullmatch(candidate.name) and candidate.parent.name == "snapshots"
                and candidate.parent.parent.name.startswith("models--")):
            return candidate.name
    if not path.name.startswith("models--") or not (path / "snapshots").is_dir():
        return None
    if revision is not None and _COMMIT.fullmatch(revision):
        return revision if (path / "snapshots" / revision).is_dir() else None
    ref = path / "refs" / (revision or "main")
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def fingerprint(directory: Path) -> WeightsIdentity | None:
    """``fp-<32 hex>`` of the weights in ``directory`` (see the module docstring); None when
    it holds no weights file. Raises ``WeightsError`` naming an unreadable or malformed file."""
    files = sorted(
        (p for p in directory.rglob("*")
         if p.suffix in WEIGHT_SUFFIXES and p.is_file()
         and not any(part.startswith(".") for part in p.relative_to(directory).parts)),
        key=lambda p: p.relative_to(directory).as_posix(),
    )
    if not files:
        return None
    digest = hashlib.sha256(_TAG)
    config = directory / "config.json"
    if config.is_file():
        data = _read(config, 0, MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise WeightsError(f"{config}: over {MAX_CONFIG_BYTES} bytes; not a model config")
        _field(digest, b"config.json", data)
    total = 0
    for file in files:
        size = file.stat().st_size
        total += size
        _field(digest, b"file", file.relative_to(directory).as_posix().encode())
        _field(digest, b"size", str(size).encode())
        start = 0
        if file.suffix == ".safetensors":
            header = _safetensors_header(file, size)
            _field(digest, b"header", header)
            start = 8 + len(header)
        for offset, length in sample_ranges(start, size):
            _field(digest, b"sample", _read(file, offset, length))
    return WeightsIdentity(
        f"fp-{digest.hexdigest()[:32]}",
        f"fingerprint of {len(files)} weights file{'s' if len(files) > 1 else ''}, "
        f"{total} bytes",
    )


def sample_ranges(start: int, stop: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges a fingerprint reads of the bytes ``[start, stop)``:
    all of them when they are at most ``SAMPLES * SAMPLE_BYTES``, else ``SAMPLES`` ranges of
    ``SAMPLE_BYTES`` at the start, the middle and the end."""
    span = stop - start
    if span <= SAMPLES * SAMPLE_BYTES:
        return [(start, span)] if span > 0 else []
    last = span - SAMPLE_BYTES
    return [(start + last * i // (SAMPLES - 1), SAMPLE_BYTES) for i in range(SAMPLES)]


def _safetensors_header(file: Path, size: int) -> bytes:
    """The JSON header of a safetensors file (its length is the first 8 bytes, little-endian),
    checked to lie within the file and to parse."""
    head = _read(file, 0, 8)
    if len(head) < 8:
        raise WeightsError(f"{file}: shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise WeightsError(f"{file}: safetensors header of {length} bytes does not fit the file "
                           f"({size} bytes)")
    header = _read(file, 8, length)
    try:
        json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{file}: the safetensors header is not JSON ({exc})") from None
    return header


def _read(file: Path, offset: int, length: int) -> bytes:
    try:
        with open(file, "rb") as f:
            return os.pread(f.fileno(), length, offset)
    except OSError as exc:
        raise WeightsError(f"{file}: {exc.strerror or exc}") from None


def _field(digest: hashlib._Hash, name: bytes, value: bytes) -> None:
    """One length-prefixed field, so that no two inputs hash the same bytes."""
    digest.update(struct.pack("<QQ", len(name), len(value)) + name + value)


def _looks_like_hub_id(text: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text)) and not text.startswith(".")


def _hub_cache() -> Path:
    """Where ``huggingface_hub`` keeps downloaded repos (its own environment rules)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "hub"
