"""Damaged objects are replaced by the engine that finds them, whatever the damage and the route.

A store written by one engine of the tiny Llama (three prompts sharing a system prompt), then
damaged on disk in the ways an object goes bad: a payload bit flipped, a header byte flipped,
the object truncated; in shared and unshared pages, first and later pages of a request. Then:

* a fresh engine on that store serves the same prompts (concurrently, more KV than vLLM holds,
  so requests are preempted and looked up again) with tokens equal to recompute, and when it
  has ended every damaged object has been rewritten and verifies;
* a second fresh engine on the same store recomputes none of those pages (no load failure, no
  corrupt object, every full page served) and changes no object.

The same for the secondary tier route (``HiCacheStoreTier``), whose rows are damaged alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import BLOCK, counter, scheduler_connector, tokenize, worker_connector
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, connector_config, make_llm, sentence

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig
from hicache_store.layout.hashing import page_hashes
from hicache_store.ops.inspection import inspect_store

#: real engines, minutes on 2 cores
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_prompts(model_dir: Path) -> list[list[int]]:
    system = tokenize(model_dir, sentence(7, 260))
    return [system + tokenize(model_dir, sentence(13 * c + 1, 560)) for c in range(3)]


def generate_all(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts in one call: vLLM schedules them together (and preempts where KV is short)."""
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def snapshot(root: Path, hashes: list[str]) -> dict[str, bytes]:
    """The bytes of every stored object of these pages."""
    return {str(p.relative_to(root)): p.read_bytes() for h in hashes for p in objects_of(root, h)}


def corrupt_count(root: Path) -> int:
    async def check() -> int:
        backend = open_backend({"url": f"file://{root}"})
        try:
            report = await inspect_store(backend, verify=True)
        finally:
            await backend.close()
        assert report.verify is not None
        return report.verify.corrupt

    return asyncio.run(check())


@dataclasses.dataclass
class Damage:
    path: Path
    kind: str


def damage(path: Path, kind: str) -> Damage:
    data = bytearray(path.read_bytes())
    if kind == "payload":
        data[len(data) - 100] ^= 0x01
        path.write_bytes(bytes(data))
    elif kind == "header":
        data[40] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        os.truncate(path, len(data) - 4096)
    return Damage(path, kind)


def objects_of(root: Path, page_hash: str) -> list[Path]:
    found = [p for p in root.rglob(f"{page_hash}_*") if p.is_file()]
    assert found, f"no stored object for page {page_hash[:16]}"
    return found


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[list[int]]:
    return make_prompts(tiny_llama)


def head(prompt: list[int]) -> list[int]:
    """The prompt's first two pages and a token: a request that loads exactly those two."""
    return prompt[: 2 * BLOCK + 1]


def shared_pages(prompts: list[list[int]]) -> int:
    """Leading pages every prompt shares (the system prompt's full pages)."""
    first, *others = [page_hashes(p, BLOCK) for p in prompts]
    return next((i for i, h in enumerate(first) if any(o[i] != h for o in others)), len(first))


def short(prompts: list[list[int]]) -> list[int]:
    """The first prompt up to its second own page and a token."""
    return prompts[0][: (shared_pages(prompts) + 2) * BLOCK + 1]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens without any connector, by prompt."""
    llm = make_llm(tiny_llama)
    try:
        asked = [*prompts, head(prompts[0]), short(prompts)]
        return {tuple(p): out for p, out in zip(asked, generate_all(llm, asked), strict=True)}
    finally:
        close_llm(llm)


def connector_engine(model_dir: Path, url: str, kv_role: str = "kv_both", **extra: Any) -> Any:
    # The default L2 (the user's): a fresh engine's is empty, so every page comes from the
    # store.
    config = connector_config({"url": url, **extra}, kv_role=kv_role)
    return make_llm(model_dir, kv_transfer_config=config, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def written(
    tiny_llama: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A store holding every page of the prompts, written by an engine (copied per test)."""
    root = tmp_path_factory.mktemp("written") / "store"
    llm = connector_engine(tiny_llama, f"file://{root}")
    try:
        for p in prompts:  # one at a time: every page stored
            generate_all(llm, [p])
        worker_connector().flush()
    finally:
        close_llm(llm)
    assert corrupt_count(root) == 0
    return root


def copy_store(written: Path, into: Path) -> Path:
    root = into / "store"
    shutil.copytree(written, root)
    return root


def test_connector_replaces_every_damaged_object(
    tiny_llama: Path, prompts: list[list[int]], reference: dict[tuple[int, ...], list[int]],
    written: Path, tmp_path: Path,
) -> None:
    root = copy_store(written, tmp_path)
    hashes = [page_hashes(p, BLOCK) for p in prompts]
    shared = shared_pages(prompts)
    assert shared >= 2
    plan = [  # (prompt, page, kind): shared and own pages, first failures and later ones
        (0, 0, "payload"), (0, shared + 1, "truncate"),
        (1, 1, "header"), (1, shared, "payload"), (1, shared + 2, "header"),
        (2, shared + 0, "truncate"), (2, shared + 1, "payload"), (2, shared + 3, "header"),
    ]
    damaged = []
    for c, page, kind in plan:
        assert page < (len(prompts[c]) - 1) // BLOCK
        (path,) = objects_of(root, hashes[c][page])
        damaged.append(damage(path, kind))
    assert corrupt_count(root) == len(damaged)

    llm = connector_engine(tiny_llama, f"file://{root}")
    try:
        # First a request whose every loaded page is damaged (its two first pages), then all
        # prompts together.
        assert generate_all(llm, [head(prompts[0])]) == [reference[tuple(head(prompts[0]))]]
        assert generate_all(llm, prompts) == [reference[tuple(p)] for p in prompts]
        worker = worker_connector()
        worker.flush()
        assert worker.metrics["corrupt_objects"] >= 1
        # vLLM's counter counts what the connector offered, failed loads included; the
        # connector's own Prometheus counters split it into served and recomputed.
        offered = counter(llm, "vllm:external_prefix_cache_hits")
        served = counter(llm, "vllm:hicache_store_loaded_tokens")
        failed = counter(llm, "vllm:hicache_store_load_failed_tokens")
        assert failed > 0 and served + failed == offered
        assert served == worker.metrics["pages_loaded"] * BLOCK
    finally:
        close_llm(llm)
    # Every damaged object was rewritten (present, and it verifies), nothing is left corrupt.
    assert all(d.path.is_file() for d in damaged), [d.kind for d in damaged if not d.path.is_file()]
    assert corrupt_count(root) == 0

    offered = sorted({h for p, hs in zip(prompts, hashes, strict=True)
                      for h in hs[:(len(p) - 1) // BLOCK]})
    before = snapshot(root, offered)
    llm = connector_engine(tiny_llama, f"file://{root}")
    try:
        served = counter(llm, "vllm:external_prefix_cache_hits")
        for p in prompts:
            assert generate_all(llm, [p]) == [reference[tuple(p)]]
        worker, sched = worker_connector(), scheduler_connector(llm)
        worker.flush()
        assert worker.metrics["load_failures"] == 0
        assert worker.metrics["corrupt_objects"] == 0
        assert counter(llm, "vllm:external_prefix_cache_hits") - served > 0
        assert counter(llm, "vllm:hicache_store_loaded_tokens") == counter(
            llm, "vllm:external_prefix_cache_hits")
        assert sched.metrics["lookup_hit_pages"] > 0
    finally:
        close_llm(llm)
    assert snapshot(root, offered) == before


def test_a_load_only_engine_deletes_what_fails_and_never_offers_it_again(
    tiny_llama: Path, prompts: list[list[int]], reference: dict[tuple[int, ...], list[int]],
    written: Path, tmp_path: Path,
) -> None:
    """``kv_consumer`` saves nothing, so only a delete can stop the store listing a damaged
    object; and where the delete fails too, the engine does not read that page again."""
    root = copy_store(written, tmp_path)
    hashes = [page_hashes(p, BLOCK) for p in prompts]
    shared = shared_pages(prompts)
    (kept,) = objects_of(root, hashes[0][shared + 1])
    damage(kept, "payload")
    (dropped,) = objects_of(root, hashes[1][shared + 1])
    damage(dropped, "header")
    asked = short(prompts)  # loads up to the damaged page
    llm = connector_engine(tiny_llama, f"faulty://?inner=file://{root}", retry_after_s=0,
                           l2_mib=0, kv_role="kv_consumer")
    try:
        sched, worker = scheduler_connector(llm), worker_connector()
        # Deletes fail: the page stays damaged in the store.
        worker.backend.faults = FaultConfig(write_error_rate=1.0)
        assert generate_all(llm, [asked]) == [reference[tuple(asked)]]
        assert worker.metrics["load_failures"] == 1 and worker.metrics["corrupt_objects"] == 1
        assert kept.is_file() and corrupt_count(root) == 2
        # Asked again (vLLM's own cache emptied): the store still lists it, the engine does
        # not read it again.
        assert llm.reset_prefix_cache()
        assert generate_all(llm, [asked]) == [reference[tuple(asked)]]
        assert worker.metrics["load_failures"] == 1 and worker.metrics["corrupt_objects"] == 1
        assert sched.metrics["lookup_refuted_pages"] == 1
        # Deletes work: another prompt's damaged page is read once and deleted.
        worker.backend.faults = FaultConfig()
        assert llm.reset_prefix_cache()
        assert generate_all(llm, [prompts[1]]) == [reference[tuple(prompts[1])]]
        worker.flush()
        assert worker.metrics["corrupt_objects"] == 2 and worker.metrics["corrupt_deleted"] == 1
        assert not dropped.exists() and kept.is_file()
        assert worker.metrics["pages_saved"] == 0
    finally:
        close_llm(llm)


# -- the secondary tier route -------------------------------------------------------------------


def tier_engine(model_dir: Path, root: Path) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group

    assert not has_kv_transfer_group(), "another engine with a KV connector is still open"
    return make_llm(model_dir, kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
            # room for every chunk of the prompts: promotions never wait for primary space
            "cpu_bytes_to_use": 32 << 20,
            "secondary_tiers": [{
                "type": "HiCacheStoreTier",
                "module_path": "hicache_store.integrations.vllm.secondary_tier",
                "url": f"file://{root}",
            }],
        },
    ))


def tier_of(llm: Any) -> Any:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    (tier,) = scheduler.connector.connector_scheduler.manager.secondary_tiers
    return tier


def row_objects(root: Path) -> list[Path]:
    return sorted(p for p in (root / "objects").rglob("*") if p.is_file())


def test_secondary_tier_replaces_every_damaged_object(
    tiny_llama: Path, prompts: list[list[int]], reference: dict[tuple[int, ...], list[int]],
    tmp_path: Path,
) -> None:
    root = tmp_path / "tier-store"
    llm = tier_engine(tiny_llama, root)
    try:
        for p in prompts:
            generate_all(llm, [p])
        tier_of(llm).drain_jobs()
    finally:
        close_llm(llm)
    rows = row_objects(root)
    assert len(rows) >= 12 and corrupt_count(root) == 0
    kinds = ["payload", "header", "truncate"]
    damaged = [damage(path, kinds[i % 3]) for i, path in enumerate(rows[1::2][:9])]
    assert corrupt_count(root) == len(damaged)

    llm = tier_engine(tiny_llama, root)
    try:
        assert generate_all(llm, prompts) == [reference[tuple(p)] for p in prompts]
        tier = tier_of(llm)
        tier.drain_jobs()
        assert tier.stats.corruptions >= 1
    finally:
        close_llm(llm)
    assert all(d.path.is_file() for d in damaged), [d.kind for d in damaged if not d.path.is_file()]
    assert corrupt_count(root) == 0

    before = {p: p.read_bytes() for p in rows}
    llm = tier_engine(tiny_llama, root)
    try:
        for p in prompts:
            assert generate_all(llm, [p]) == [reference[tuple(p)]]
        tier = tier_of(llm)
        tier.drain_jobs()
        assert tier.stats.loaded > 0
        assert tier.stats.corruptions == 0 and tier.stats.load_misses == 0
    finally:
        close_llm(llm)
    assert {p: p.read_bytes() for p in rows} == before
