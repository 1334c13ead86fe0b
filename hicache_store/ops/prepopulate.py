"""Offline prepopulation: compute prompts' KV with a real model and store it as every rank would.

Filling L3 with reusable KV before requests arrive saves their prefill. ``prepopulate`` does it for a *target* deployment: a
namespace (model, KV dtype, page size, grid, tenant) and a writer topology (TP x PP). For each
full page of each prompt it writes exactly the objects the topology's ranks would write
themselves (``plan_writes`` per rank: one writer among replicas), framed by the same
``L3Link.write_page`` the cache tier uses, so a deployment of that namespace finds them as its
own. Any other topology can read them: the layout is topology-free.

Procedure, per batch of ``batch_size`` prompts:

1. hash each prompt's full pages (the namespace's chain hash; a partial last page is never
   stored) and drop pages already handled in this run (shared prefixes);
2. one batched ``exists`` over every object of every remaining page: a page whose objects all
   exist is skipped (resumable: an interrupted run, rerun, writes only what is missing), and of
   the others only the ranks with a missing object write;
3. one forward pass per prompt that has a missing page, over the prompt's full pages (always
   the same tokens, so a rerun computes identical bytes);
4. each missing rank's host page built in the ``page_unified`` layout of its shard and written
   with ``L3Link.write_page``, parent-first within each chain (see ``_write_waves``); the
   writes of one wave run concurrently, bounded by ``max_inflight_bytes``.

With a tenant key ring (``keys``) the namespace is sealed and every object is sealed with the
ring's active key; a page counts as present only under the active key, so rerunning after a
rotation re-seals the prepopulated KV under the new key (the old copies stay readable until
their key is retired and ``hicache-store gc --remove-retired`` removes them).

The namespace's manifest (``ops.manifest``) is written before the first object. ``dry_run``
does steps 1-2 only and reports what would be written. A failed write is counted (the summary
reports it and the CLI exits 1); the run goes on, and a rerun retries it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_store.backends.base import Backend
from hicache_store.backends.lifetime import gather_settled
from hicache_store.layout.errors import GridMismatchError
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.keys import ObjectCoords
from hicache_store.layout.namespace import Namespace, weights_revision
from hicache_store.layout.plans import plan_writes
from hicache_store.layout.topology import Topology
from hicache_store.objects import IOStats, L3Link, failures
from hicache_store.tenant import KeyRing

from .manifest import ensure_manifest
from .sources import KVSource, LayerKV

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PrepopulateReport:
    """What a run did (or, with ``dry_run``, would do). Tokens count full pages only."""

    prompts: int = 0
    prompts_computed: int = 0
    pages: int = 0
    pages_present: int = 0
    pages_written: int = 0
    objects_written: int = 0
    bytes_written: int = 0
    tokens_computed: int = 0
    write_failures: int = 0
    seconds: float = 0.0
    dry_run: bool = False
    namespace: str = ""
    topology: str = ""
    ranks_writing: int = 0
    objects_per_page: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Progress:
    """Totals handed to the progress callback after each batch."""

    pages_total: int
    pages_done: int = 0
    tokens_done: int = 0
    bytes_done: int = 0
    started: float = field(default_factory=time.monotonic)


def namespace_for(
    source: KVSource, *, page_size: int, grid: Any, model_revision: str | None = None,
    **options: Any,
) -> Namespace:
    """The namespace of ``source``'s KV with a page size, grid and namespace options; its
    ``model_revision`` is ``model_revision`` when given, else the identity of the source's
    weights (``weights_revision``: what the engine integrations derive from the same files)."""
    identity = source.weights.value if source.weights is not None else None
    return Namespace.create(source.model_name, source.shape, source.dtype, page_size, grid,
                            model_revision=weights_revision(model_revision, identity),
                            **options)


def page_rows(namespace: Namespace, layout: UnifiedPageLayout, kv: LayerKV,
              page: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """One page of one shard in the ``page_unified`` layout, as host bytes.

    ``kv[layer] = (K, V)``, each ``[kv_heads, seq, head_dim]``; the page is tokens
    ``[page * page_size, (page + 1) * page_size)``. Blocks follow ``layout.blocks``: each is
    ``(layer, K/V, token, head, dim)`` over the shard's layers, row-major.
    """
    p = namespace.page_size
    want = _TORCH_DTYPES.get(namespace.dtype)
    parts = []
    for block in layout.blocks:
        planes = [
            torch.stack((k[block.head_start:block.head_stop, page * p:(page + 1) * p],
                         v[block.head_start:block.head_stop, page * p:(page + 1) * p]))
            for k, v in kv[layout.layer_start:layout.layer_stop]
        ]
        # [layer, plane, head, token, dim] -> [layer, plane, token, head, dim]
        block_t = torch.stack(planes).permute(0, 1, 3, 2, 4).contiguous()
        if want is None or block_t.dtype != want:
            raise ValueError(f"KV dtype {block_t.dtype} does not match namespace {namespace.dtype}")
        parts.append(block_t.cpu().reshape(-1).view(torch.uint8).numpy())
    row = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if row.nbytes != layout.page_bytes:
        raise ValueError(f"page row of {row.nbytes} bytes, layout says {layout.page_bytes}")
    return row


async def prepopulate(
    backend: Backend,
    source: KVSource,
    token_lists: Sequence[Sequence[int]],
    namespace: Namespace,
    topology: Topology,
    *,
    batch_size: int = 8,
    dry_run: bool = False,
    max_inflight_bytes: int = 256 << 20,
    io_timeout_s: float = 120.0,
    keys: KeyRing | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> PrepopulateReport:
    """Store the KV of every full page of ``token_lists`` for ``namespace`` as ``topology``'s
    ranks would (see the module docstring). Returns the report; raises only for what is broken
    before writing starts: a topology whose ranks cannot write every object of a page
    (``GridMismatchError``, see ``check_writer_topology``), a backend that cannot answer.
    ``keys``: the tenant key ring of a sealed namespace (objects sealed with its active key)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    check_writer_topology(namespace, topology)
    started = time.monotonic()
    links = [
        L3Link(backend, namespace, topology, rank, max_inflight_bytes=max_inflight_bytes,
               io_timeout_s=io_timeout_s, keys=keys)
        for rank in range(topology.world_size)
    ]
    writers = [link for link in links if link.can_write]
    report = PrepopulateReport(
        prompts=len(token_lists), dry_run=dry_run, namespace=namespace.digest,
        topology=str(topology), ranks_writing=len(writers),
        objects_per_page=sum(len(link.write_plan.objects) for link in writers
                             if link.write_plan is not None),
    )
    hashes = [page_hashes(list(t), namespace.page_size, algo=namespace.hash_algo)
              for t in token_lists]
    seen: set[str] = set()
    unique_total = len({h for hs in hashes for h in hs})
    # Each page's predecessor in its chain, recorded in the objects' headers for gc.
    parent_of = {h: (hs[j - 1] if j else None) for hs in hashes for j, h in enumerate(hs)}
    state = Progress(pages_total=unique_total, started=started)
    if not dry_run and unique_total:
        await ensure_manifest(backend, namespace)
    for first in range(0, len(token_lists), batch_size):
        batch = range(first, min(first + batch_size, len(token_lists)))
        # Pages new to this run, per prompt, with their page index in the prompt.
        todo: dict[int, list[tuple[int, str]]] = {}
        for i in batch:
            for page, h in enumerate(hashes[i]):
                if h not in seen:
                    seen.add(h)
                    todo.setdefault(i, []).append((page, h))
        pending = [(i, page, h) for i, pages in todo.items() for page, h in pages]
        missing = await _missing_ranks(writers, [h for _, _, h in pending])
        report.pages += len(pending)
        report.pages_present += sum(1 for m in missing if not m)
        work: dict[int, list[tuple[int, str, list[L3Link]]]] = {}
        for (i, page, h), ranks in zip(pending, missing, strict=True):
            if ranks:
                work.setdefault(i, []).append((page, h, ranks))
        computed: list[tuple[LayerKV, list[tuple[int, str, list[L3Link]]]]] = []
        for i, pages in work.items():
            if dry_run:
                report.pages_written += len(pages)
                for _page, _h, ranks in pages:
                    objs = [o for link in ranks if link.write_plan is not None
                            for o in link.write_plan.objects]
                    report.objects_written += len(objs)
                    report.bytes_written += sum(o.nbytes + _header(o.coords.num_layers)
                                                for o in objs)
                continue
            full = len(hashes[i]) * namespace.page_size
            computed.append((source.kv(list(token_lists[i])[:full]), pages))
            report.prompts_computed += 1
            report.tokens_computed += full
            state.tokens_done += full
        await _write_waves(namespace, computed, report, parent_of)
        state.pages_done += len(pending)
        state.bytes_done = report.bytes_written
        if progress is not None:
            progress(state)
    failures.flush(backend)  # the failures counted since the last ones logged, in one line
    report.seconds = time.monotonic() - started
    return report


def check_writer_topology(namespace: Namespace, topology: Topology) -> None:
    """Raise ``GridMismatchError`` unless ``topology``'s ranks together write every object of
    a page of ``namespace``.

    A rank whose shard does not align with the grid cannot write (the cache tier then only
    reads, and warns); for prepopulation that is an error: pages missing some objects are
    misses for every reader, so a run that "succeeds" would fill the store with KV nobody can
    use. The first misaligned rank's error names the grids that would work.
    """
    written: set[ObjectCoords] = set()
    for rank in range(topology.world_size):
        plan = plan_writes(namespace, topology, rank)  # raises for a misaligned rank
        written.update(obj.coords for obj in plan.objects)
    needed = {obj.coords for obj in plan_writes(namespace, Topology(1, 1), 0).objects}
    # Aligned ranks always cover the grid together; checked anyway, since a page with a hole
    # is exactly the silent loss this function exists to prevent.
    if written != needed:
        raise GridMismatchError(
            f"the ranks of {topology} write {len(written & needed)} of the {len(needed)} objects "
            f"of each page of grid {namespace.grid}"
        )


def _header(num_layers: int) -> int:
    from hicache_store.layout.framing import payload_offset

    return payload_offset(num_layers)


async def _missing_ranks(writers: Sequence[L3Link], page_hashes_: Sequence[str]
                         ) -> list[list[L3Link]]:
    """For each page, the writer links with at least one object missing (one ``exists``)."""
    if not page_hashes_ or not writers:
        return [[] for _ in page_hashes_]
    keys: list[str] = []
    spans: list[tuple[int, int]] = []
    for h in page_hashes_:
        for link in writers:
            assert link.write_plan is not None
            own = link.write_names(h)
            spans.append((len(keys), len(keys) + len(own)))
            keys.extend(own)
    found = await writers[0].backend.exists(keys)
    out: list[list[L3Link]] = []
    n = len(writers)
    for p in range(len(page_hashes_)):
        out.append([link for r, link in enumerate(writers)
                    if not all(found[spans[p * n + r][0]:spans[p * n + r][1]])])
    return out


async def _write_waves(namespace: Namespace,
                       computed: Sequence[tuple[LayerKV, list[tuple[int, str, list[L3Link]]]]],
                       report: PrepopulateReport,
                       parent_of: dict[str, str | None]) -> None:
    """Write the batch's missing pages parent-first: wave ``j`` holds the ``j``-th missing page
    of every prompt (all their ranks' objects concurrently), and starts when wave ``j - 1`` is
    done. So within a chain a page is never newer than its successor, the order the cache tier
    writes in and ``hicache-store gc`` relies on to shorten chains from their tails."""
    async def one(kv: LayerKV, page: int, h: str, link: L3Link) -> tuple[bool, int, int]:
        plan = link.write_plan
        assert plan is not None
        row = page_rows(namespace, plan.page, kv, page)
        io = IOStats()
        ok = await link.write_page(h, row, io, parent_of.get(h))
        return ok, len(plan.objects), io.bytes_moved

    depth = max((len(pages) for _kv, pages in computed), default=0)
    for wave in range(depth):
        items = [(kv, pages[wave]) for kv, pages in computed if wave < len(pages)]
        # Settled: a cancelled run (Ctrl-C) ends when every write of the wave has, so the
        # caller's close never overtakes one (plain gather ends at its first cancelled child).
        results = await gather_settled(*(
            one(kv, page, h, link) for kv, (page, h, ranks) in items for link in ranks))
        index = 0
        for _kv, (_page, _h, ranks) in items:
            page_ok = True
            for _link in ranks:
                ok, objects, nbytes = results[index]
                index += 1
                if ok:
                    report.objects_written += objects
                    report.bytes_written += nbytes
                else:
                    report.write_failures += 1
                    page_ok = False
            report.pages_written += page_ok
