"""The ``sglang-ukv1`` key scheme equals SGLang 0.5.23's own unified keyspace.

For every rank of a matrix of topologies (TP, PP with SGLang's even and uneven stage splits),
grids (SGLang's defaults and explicit layer partitions and head groups) and MHA/MLA models,
SGLang's ``plan_unified_kv`` (called here, not copied) and our namespace and write plan give the
same digest and the same object keys.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from hicache_store._sync import run_sync
from hicache_store.backends import aligned_buffer, open_backend
from hicache_store.layout.keys import format_key, parse_key
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.layout.plans import plan_reads, plan_writes
from hicache_store.layout.topology import Topology
from hicache_store.layout.ukv1 import ukv1_grid
from hicache_store.objects import IOStats, L3Link
from hicache_store.sglang_config import sglang_stage_sizes


@dataclass(frozen=True)
class Case:
    mla: bool
    layers: int
    heads: int  # total KV heads (MHA)
    tp: int
    pp: int
    layer_partition: int | None
    head_group: int | None

    @property
    def id(self) -> str:
        kind = "mla" if self.mla else f"mha{self.heads}"
        return (f"{kind}-L{self.layers}-tp{self.tp}-pp{self.pp}"
                f"-lp{self.layer_partition}-hg{self.head_group}")


def _cases() -> list[Case]:
    cases = []
    for mla, layers, heads in ((False, 8, 8), (False, 61, 8), (False, 6, 2), (True, 61, 1),
                               (True, 8, 1)):
        for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (2, 3)):
            if not mla and tp > heads:
                continue  # KV-head replication: SGLang's scheme has no keys for it
            local = heads // tp
            for lp, hg in itertools.product((None, 1, 2, layers), (None, 1, local)):
                if mla and hg not in (None,):
                    continue
                if not mla and hg is None and local == 1 and tp > 1:
                    continue  # SGLang refuses to guess (it cannot tell sharding from replication)
                case = Case(mla, layers, heads, tp, pp, lp, hg)
                if _valid_for_sglang(case):
                    cases.append(case)
    return cases


def _valid_for_sglang(case: Case) -> bool:
    """SGLang raises for a stage that does not tile the layer partition; so do we (tested
    apart); the matrix keeps the topologies SGLang can key."""
    lp = case.layer_partition
    if not lp:
        return True
    start = 0
    sizes = sglang_stage_sizes(case.layers, case.pp)
    for i, size in enumerate(sizes):
        stop = start + size
        if start % lp or (stop % lp and i != len(sizes) - 1):
            return False
        start = stop
    return True


CASES = _cases()
PAGE = "ab" * 32


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_keys_and_digests_equal_sglangs_plan_unified_kv(sglang: ModuleType, case: Case) -> None:
    scheme = sglang.module("sglang.srt.mem_cache.hicache_key_scheme")
    sizes = sglang_stage_sizes(case.layers, case.pp)
    topology = Topology(case.tp, case.pp, sizes)
    shape = ModelShape.mla(case.layers, 576) if case.mla else ModelShape.mha(case.layers, case.heads, 128)
    grid = ukv1_grid(shape, topology, layer_partition=case.layer_partition,
                     head_group=case.head_group)
    namespace = Namespace.create("org/model", shape, "bfloat16", 64, grid,
                                 key_scheme="sglang-ukv1")
    stages = topology.stage_layers(case.layers)
    for pp_rank, tp_rank in itertools.product(range(case.pp), range(case.tp)):
        start, end = stages[pp_rank]
        theirs = scheme.plan_unified_kv(
            model_id="org/model", dtype="bfloat16", page_size=64, rank_replicated=case.mla,
            local_kv_heads=1 if case.mla else case.heads // case.tp, attn_tp_rank=tp_rank,
            attn_tp_size=case.tp, attn_cp_size=1, start_layer=start, end_layer=end,
            is_final_stage=pp_rank == case.pp - 1, head_group=case.head_group,
            layer_partition=case.layer_partition,
        )
        assert namespace.digest == scheme.namespace_digest(theirs.namespace)
        rank = topology.rank_of(tp_rank, pp_rank)
        plan = plan_writes(namespace, topology, rank)
        if case.mla and tp_rank > 0:  # replicas: only TP rank 0 writes; the keys are the same
            assert plan.objects == ()
            plan = plan_reads(namespace, topology, rank)  # type: ignore[assignment]
        ours = plan.object_keys(PAGE)
        assert sorted(ours) == sorted(PAGE + "_" + suffix for suffix in theirs.suffixes)
        for key in ours:
            assert format_key(parse_key(key)) == key


def test_the_namespace_equals_sglangs_derived_namespace(sglang: ModuleType) -> None:
    """Field by field, not only the digest: the encoding SGLang hashes is ours."""
    import msgspec

    scheme = sglang.module("sglang.srt.mem_cache.hicache_key_scheme")
    shape = ModelShape.mha(40, 8, 128)
    for grid_args in ((None, None), (8, 2), (0, 4)):
        grid = ukv1_grid(shape, Topology(2, 1), layer_partition=grid_args[0],
                         head_group=grid_args[1])
        ns = Namespace.create("Qwen/Qwen3-32B", shape, "float8_e4m3fn", 32, grid,
                              key_scheme="sglang-ukv1")
        theirs = scheme.derive_namespace(
            model_id="Qwen/Qwen3-32B", dtype="float8_e4m3fn", page_size=32,
            rank_replicated=False, total_kv_heads=8, head_group=grid.heads_per_group,
            layer_partition=grid.layers_per_chunk,
        )
        assert ns.ukv1_fields() == msgspec.structs.asdict(theirs)
        assert ns.ukv1_encoding() == msgspec.msgpack.encode(theirs)
        assert ns.digest == scheme.namespace_digest(theirs)


def test_stage_split_is_sglangs(sglang: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    utils = sglang.module_any("sglang.srt.distributed.utils")
    for layers, pp in ((61, 2), (61, 4), (62, 4), (7, 3), (8, 8)):
        sizes = sglang_stage_sizes(layers, pp)
        start = 0
        for rank, size in enumerate(sizes):
            assert utils.get_pp_indices(layers, rank, pp) == (start, start + size)
            start += size
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "20,41")
    assert sglang_stage_sizes(61, 2) == (20, 41)
    assert utils.get_pp_indices(61, 1, 2) == (20, 61)


INTEROP = [c for c in CASES if c.layers == 8 and (c.tp, c.pp) in ((2, 2), (4, 1), (1, 2))
           and c.layer_partition in (None, 2) and c.head_group in (None, 1)]


@pytest.mark.parametrize("case", INTEROP, ids=[c.id for c in INTEROP])
def test_objects_are_sglangs_page_unified_chunks(sglang: ModuleType, case: Case,
                                                 tmp_path: Path) -> None:
    """Our bare objects are byte for byte the chunks of SGLang's ``page_unified`` page block
    (``PageUnifiedLayout.chunk_span``), under SGLang's keys; objects SGLang would store are
    read back by any other topology of ours."""
    scheme = sglang.module("sglang.srt.mem_cache.hicache_key_scheme")
    unified = sglang.module_any("sglang.srt.mem_cache.pool_host.page_unified")
    head_dim, page_size = 8, 4
    sizes = sglang_stage_sizes(case.layers, case.pp)
    topology = Topology(case.tp, case.pp, sizes)
    shape = (ModelShape.mla(case.layers, head_dim) if case.mla
             else ModelShape.mha(case.layers, case.heads, head_dim))
    grid = ukv1_grid(shape, topology, layer_partition=case.layer_partition,
                     head_group=case.head_group)
    ns = Namespace.create("org/model", shape, "bfloat16", page_size, grid,
                          key_scheme="sglang-ukv1")
    backend = open_backend(f"file://{tmp_path}/kv")
    stages = topology.stage_layers(case.layers)
    expected: dict[str, bytes] = {}
    for pp_rank, tp_rank in itertools.product(range(case.pp), range(case.tp)):
        start, end = stages[pp_rank]
        local = 1 if case.mla else case.heads // case.tp
        theirs = scheme.plan_unified_kv(
            model_id="org/model", dtype="bfloat16", page_size=page_size,
            rank_replicated=case.mla, local_kv_heads=local, attn_tp_rank=tp_rank,
            attn_tp_size=case.tp, attn_cp_size=1, start_layer=start, end_layer=end,
            is_final_stage=pp_rank == case.pp - 1, head_group=case.head_group,
            layer_partition=case.layer_partition,
        )
        block_layout = unified.PageUnifiedLayout(
            page_size=page_size, layer_num=end - start, head_num=local,
            head_group_num=theirs.head_group_num, head_dim=head_dim, itemsize=2,
            is_mla=case.mla,
        )
        rank = topology.rank_of(tp_rank, pp_rank)
        link = L3Link(backend, ns, topology, rank, max_inflight_bytes=1 << 20, io_timeout_s=30)
        assert link.read_plan.page.page_bytes == block_layout.bytes_per_page
        block = np.random.default_rng(rank).integers(
            0, 256, block_layout.bytes_per_page, dtype=np.uint8)
        row = np.frombuffer(aligned_buffer(block.nbytes), dtype=np.uint8)
        row[:] = block
        if link.can_write:
            assert run_sync(link.write_page(PAGE, row, IOStats()), timeout=60)
        if case.mla and tp_rank:
            continue
        for i, layers in enumerate(theirs.layer_ranges):
            for j in range(theirs.head_group_num):
                offset, length = block_layout.chunk_span(layers, j)
                suffix = theirs.suffixes[i * theirs.head_group_num + j]
                expected[PAGE + "_" + suffix] = block[offset : offset + length].tobytes()
    assert sorted(run_sync(_keys(backend), timeout=60)) == sorted(expected)
    for key, data in expected.items():
        assert run_sync(backend.get_bytes(key), timeout=60) == data
    # SGLang's objects (the same bytes, stored raw) read back by another topology of ours
    other = Topology(1, 1)
    reader = L3Link(backend, ns, other, 0, max_inflight_bytes=1 << 20, io_timeout_s=30)
    got = np.frombuffer(aligned_buffer(reader.read_plan.page.page_bytes), dtype=np.uint8)
    assert run_sync(reader.read_page(PAGE, got, IOStats()), timeout=60)
    run_sync(backend.close(), timeout=60)


async def _keys(backend: Any) -> list[str]:
    return [k async for k in backend.list_prefix("")]


def test_sglangs_controller_stores_under_sglangs_unified_keys(sglang: ModuleType, url: str,
                                                              tmp_path: Path) -> None:
    """A TP2 x PP2 server with ``"key_scheme": "sglang-ukv1"`` (SGLang's default grid) stores
    exactly the objects SGLang's ``plan_unified_kv`` names, bare; another layout reads them."""
    scheme = sglang.module("sglang.srt.mem_cache.hicache_key_scheme")
    layers, heads, pp, tp = 8, 4, 2, 2
    extra = {"key_scheme": "sglang-ukv1", "num_layers": layers}
    tokens = sglang.tokens_for(2, 4, seed=21)
    pages: dict[tuple[int, int], list[Any]] = {}
    expected: set[str] = set()
    for pp_rank, tp_rank in itertools.product(range(pp), range(tp)):
        geometry = sglang.Geometry(layers=layers // pp, heads=heads // tp,
                                   start_layer=pp_rank * layers // pp)
        rank = sglang.Rank(url, layout="page_first", geometry=geometry,
                           parallel=sglang.parallel_state(tp_rank, tp, pp_rank, pp), extra=extra)
        pages[pp_rank, tp_rank] = [rank.random_page(10 * pp_rank + tp_rank + s) for s in (0, 1)]
        assert rank.backup(tokens, pages[pp_rank, tp_rank]) == len(tokens)
        theirs = scheme.plan_unified_kv(
            model_id="org/model", dtype="bfloat16", page_size=4, rank_replicated=False,
            local_kv_heads=heads // tp, attn_tp_rank=tp_rank, attn_tp_size=tp, attn_cp_size=1,
            start_layer=geometry.start_layer, end_layer=geometry.start_layer + geometry.layers,
            is_final_stage=pp_rank == pp - 1,
        )
        expected |= {h + "_" + suffix for h in rank.hashes(tokens) for suffix in theirs.suffixes}
        rank.close()
    stored = {p.name for p in (tmp_path / "kv").rglob("*") if p.is_file() and "_ukv1-" in p.name}
    assert stored == expected
    payload = 2 * 4 * (layers // pp) * (heads // tp) * 8 * 2  # K/V, tokens, layers, heads, dim
    assert {p.stat().st_size for p in (tmp_path / "kv").rglob("*_ukv1-*")} == {payload}
    for pp_rank, tp_rank in itertools.product(range(pp), range(tp)):  # same topology, page_head
        geometry = sglang.Geometry(layers=layers // pp, heads=heads // tp,
                                   start_layer=pp_rank * layers // pp)
        reader = sglang.Rank(url, layout="page_head", geometry=geometry,
                             parallel=sglang.parallel_state(tp_rank, tp, pp_rank, pp),
                             extra=extra)
        hit, loaded, host_indices = reader.prefetch(tokens)
        assert (hit, loaded) == (len(tokens), len(tokens))
        assert host_indices is not None
        for i, data in enumerate(pages[pp_rank, tp_rank]):
            assert torch.equal(reader.host_page_of(host_indices, i).contiguous().view(torch.int16),
                               data.view(torch.int16))
        reader.close()
    # SGLang's default grid keys this TP size's heads: a TP1 server misses, as in SGLang
    tp1 = sglang.Rank(url, geometry=sglang.Geometry(layers=layers, heads=heads),
                      extra={"key_scheme": "sglang-ukv1"})
    assert tp1.prefetch(tokens)[0] == 0
    tp1.close()


def test_a_shared_ukv1_grid_serves_every_topology(sglang: ModuleType, url: str) -> None:
    layers, heads = 8, 4
    extra = {"key_scheme": "sglang-ukv1", "grid": "4x1", "num_layers": layers}
    tokens = sglang.tokens_for(2, 4, seed=22)
    g = torch.Generator().manual_seed(5)
    full = [torch.randint(-30000, 30000, (2, layers, 4, heads, 8), generator=g,
                          dtype=torch.int16).view(torch.bfloat16) for _ in range(2)]
    for tp_rank in range(2):  # TP2 writers
        rank = sglang.Rank(url, geometry=sglang.Geometry(layers=layers, heads=2),
                           parallel=sglang.parallel_state(tp_rank, 2), extra=extra)
        assert rank.backup(tokens, [p[:, :, :, 2 * tp_rank : 2 * tp_rank + 2] for p in full]) == 8
        rank.close()
    reader = sglang.Rank(url, layout="layer_first", geometry=sglang.Geometry(layers=4, heads=4,
                         start_layer=4), parallel=sglang.parallel_state(0, 1, 1, 2), extra=extra)
    hit, loaded, host_indices = reader.prefetch(tokens)  # a PP2 stage of a TP1 deployment
    assert (hit, loaded) == (8, 8) and host_indices is not None
    for i, page in enumerate(full):
        assert torch.equal(reader.host_page_of(host_indices, i).contiguous().view(torch.int16),
                           page[:, 4:].contiguous().view(torch.int16))
    reader.close()


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"key_scheme": "sglang-ukv1", "tenant_salt": "t"}, "cache_salt"),
        ({"key_scheme": "sglang-ukv1", "object_format": "framed"}, "object_format"),
        ({"object_format": "page-unified-v1"}, "object_format"),
        ({"key_scheme": "sglang-ukv1", "share_with": ["tp=1,pp=1"]}, "share_with"),
        ({"key_scheme": "ukv2"}, "key_scheme"),
    ],
)
def test_what_the_ukv1_keyspace_cannot_hold_fails_at_startup(
    sglang: ModuleType, url: str, extra: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        sglang.Rank(url, extra=extra)
