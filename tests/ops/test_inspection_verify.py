"""inspect / verify / delete-corrupt on a file store filled by prepopulate (MiniLlama KV), and
gc shortening chains from their tails."""

from __future__ import annotations

from pathlib import Path

from hicache_store.backends import aligned_buffer, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.framing import ObjectHeader
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import object_key_parts, parse_key
from hicache_store.layout.namespace import Grid, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import ObjectIO
from hicache_store.ops.gc import collect_garbage
from hicache_store.ops.inspection import HEADER_MAX, inspect_store, verify_object
from hicache_store.ops.manifest import manifest_key
from hicache_store.ops.prepopulate import namespace_for, prepopulate

PAGE = 8


def prompts() -> list[list[int]]:
    # Three chains of 5, 4 and 3 full pages (plus a partial page that is never stored).
    return [[(7 * p + t) % 500 for t in range(n * PAGE + 3)] for p, n in enumerate((5, 4, 3))]


async def filled(tmp_path: Path, topology: Topology | None = None, *,
                 source: MiniEngineSource | None = None, name: str = "store",
                 ) -> tuple[FileBackend, Namespace]:
    source = source or MiniEngineSource("tiny")
    ns = namespace_for(source, page_size=PAGE, grid=Grid(2, 1))
    backend = open_backend(f"file://{tmp_path / name}")
    assert isinstance(backend, FileBackend)
    report = await prepopulate(backend, source, prompts(), ns, topology or Topology(2, 2))
    assert report.pages_written == 12 and report.write_failures == 0
    return backend, ns


async def object_keys(backend: FileBackend, digest: str) -> list[str]:
    return sorted([k async for k in backend.list_prefix()
                   if (parts := object_key_parts(k)) is not None and parts[1] == digest])


async def test_inspect_lists_namespaces_from_manifests(tmp_path: Path) -> None:
    backend, ns = await filled(tmp_path)
    # An object of a namespace without a manifest, and a key that is no object at all.
    await backend.put(["a" * 64 + "_" + "0" * 16 + "_L0-0_H0"], [b"x" * 10])
    await backend.put(["X_ab12"], [b"hello"])
    report = await inspect_store(backend)
    known, unknown = sorted(report.namespaces, key=lambda n: n.namespace is None)
    assert known.namespace == ns and known.digest == ns.digest
    assert (known.pages, known.objects) == (12, 12 * 4)  # 2 chunks x 2 head groups
    stats = await backend.stat(await object_keys(backend, ns.digest))
    assert known.bytes == sum(st.size for st in stats if st is not None)
    assert unknown.namespace is None and unknown.objects == 1 and unknown.pages == 1
    assert (report.manifests, report.other_keys, report.other_bytes) == (1, 1, 5)
    data = report.as_dict()
    assert data["namespaces"][0]["grid"] == "2x1" and "verify" not in data
    only = await inspect_store(backend, namespace="0" * 16)
    assert [n.digest for n in only.namespaces] == ["0" * 16]
    await backend.close()


async def test_verify_finds_an_object_corrupted_on_disk(tmp_path: Path) -> None:
    backend, ns = await filled(tmp_path)
    victim = (await object_keys(backend, ns.digest))[5]
    path = backend.path_of(victim)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(raw))
    result = (await inspect_store(backend, verify=True)).verify
    assert result is not None
    assert result.checked == 48 and result.ok == 47 and result.corrupt == 1
    assert [c["key"] for c in result.corrupt_examples] == [victim]
    assert "PayloadChecksumError" in result.corrupt_examples[0]["error"]
    # Dry run deletes nothing; the real run deletes exactly the corrupt object.
    dry = (await inspect_store(backend, verify=True, delete_corrupt=True, dry_run=True)).verify
    assert dry is not None and dry.deleted == 0 and dry.remaining_corrupt == 1
    assert (await backend.exists([victim])) == [True]
    done = (await inspect_store(backend, verify=True, delete_corrupt=True)).verify
    assert done is not None and done.deleted_examples == [victim] and done.remaining_corrupt == 0
    assert (await backend.exists([victim])) == [False]
    after = (await inspect_store(backend, verify=True)).verify
    assert after is not None and after.corrupt == 0 and after.ok == 47
    await backend.close()


async def test_verify_reads_through_a_small_window(tmp_path: Path) -> None:
    # Each object is a 4 KiB header and two 1 KiB layer blocks; a 1 KiB window reads them one
    # block at a time, and a bit flipped in either is found, in the right layer.
    backend, ns = await filled(tmp_path, Topology(1, 1))
    keys = await object_keys(backend, ns.digest)
    sizes = {st.key: st.size for st in await backend.stat(keys) if st is not None}
    assert set(sizes.values()) == {4096 + 2048}
    buffer = aligned_buffer(HEADER_MAX)
    io = ObjectIO(backend)
    victim = keys[3]
    reads = backend.stats.reads
    assert isinstance(await verify_object(io, victim, ns, buffer, window=1024), ObjectHeader)
    assert backend.stats.reads - reads == 1 + 2, "the header, then one read per 1 KiB block"
    reads = backend.stats.reads
    assert isinstance(await verify_object(io, victim, ns, buffer), ObjectHeader)
    assert backend.stats.reads - reads == 1 + 1, "a window that holds both blocks: one read"
    path = backend.path_of(victim)
    raw = bytearray(path.read_bytes())
    for offset, layer in ((4096 + 5, 0), (4096 + 1024 + 700, 1)):
        raw[offset] ^= 0x10
        path.write_bytes(bytes(raw))
        error = await verify_object(io, victim, ns, buffer, window=1024)
        first = parse_key(victim).coords.layer_start
        assert error == f"PayloadChecksumError: checksum mismatch in layer {first + layer}"
        raw[offset] ^= 0x10
    # Through the command's library: the same, and garbage appended to an object is
    # corruption too (its size is not the framed size).
    path.write_bytes(bytes(raw) + b"junk")
    grown = (await inspect_store(backend, verify=True, window=4096, concurrency=3)).verify
    assert grown is not None and grown.corrupt == 1 and grown.ok == len(keys) - 1
    assert grown.corrupt_examples[0]["key"] == victim
    assert "header says" in grown.corrupt_examples[0]["error"]
    await backend.close()


async def test_verify_checks_manifests_and_geometry(tmp_path: Path) -> None:
    backend, ns = await filled(tmp_path, Topology(1, 1))
    await backend.put([manifest_key(ns.digest)], [b"{not json"])
    report = await inspect_store(backend, verify=True)
    (item,) = report.namespaces
    assert item.namespace is None and "not JSON" in (item.manifest_error or "")
    assert report.verify is not None
    assert [c["key"] for c in report.verify.corrupt_examples] == [manifest_key(ns.digest)]
    await backend.close()


async def test_gc_shortens_every_chain_from_its_tail(tmp_path: Path) -> None:
    # prepopulate writes each chain parent-first; gc rebuilds the chains from the headers'
    # parent links and deletes tails only, whatever the write times.
    source = MiniEngineSource("tiny")
    backend, ns = await filled(tmp_path, source=source)
    report = await inspect_store(backend)
    total = report.bytes
    per_page = total // 12
    chains = [page_hashes(p, PAGE) for p in prompts()]
    budget = total - 5 * per_page - per_page // 2  # six pages must go
    dry = await collect_garbage(backend, max_bytes=budget, max_age=None, dry_run=True)
    assert dry.over_budget == 6 * 4 and dry.over_budget_pages == 6
    assert (await inspect_store(backend)).bytes == total  # nothing deleted
    done = await collect_garbage(backend, max_bytes=budget, max_age=None)
    assert done.failures == 0 and done.deleted == 6 * 4
    left = await inspect_store(backend)
    assert left.bytes <= budget
    present = {k.split("_")[0] for k in await object_keys(backend, ns.digest)}
    for chain in chains:
        kept = [h in present for h in chain]
        # A prefix of the chain survives: no page is kept after a deleted one.
        assert kept == sorted(kept, reverse=True), kept
    # Every surviving page is whole (all four objects).
    assert len(await object_keys(backend, ns.digest)) == 4 * len(present)
    await backend.close()
