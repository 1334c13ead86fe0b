"""The SGLang adapter through SGLang's own interface, with stand-in host pools.

These tests call the adapter directly (fast, every layout and failure case); the pools are
stand-ins with exactly the attributes the adapter reads (``HOST_POOL_ATTRIBUTES``), plus
SGLang's generic-path page methods; ``test_stand_in_matches_sglang_source`` checks those names
and every layout's buffer shape against SGLang's class source. SGLang's real controller and
host pools drive the adapter in ``test_sglang_storage_controller.py``. Pages are put into and taken
out of the stand-ins by plain tensor indexing written here (the oracle), never by the kernels
under test.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache_store.integrations.sglang import SGLANG_AVAILABLE, HiCacheStoreStorage
from hicache_store.integrations.sglang._pool import HOST_POOL_ATTRIBUTES
from hicache_store.layout.host import PoolLayout
from hicache_store.layout.namespace import kv_scales_digest

needs_sglang = pytest.mark.skipif(
    not SGLANG_AVAILABLE,
    reason="sglang is not importable (pip install --no-deps sglang==0.5.23 plus its small "
    "imports, see the test extra); the SGLang-specific checks are skipped",
)

L, H, D, P = 4, 4, 8, 4  # layers, KV heads, head dim, page size (tiny: bytes are what count)
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def keys_for(n: int, salt: str = "") -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


class StandInPool:
    """An SGLang host pool as far as the adapter sees it (MHA or MLA, any layout)."""

    def __init__(
        self,
        layout: str,
        *,
        mla: bool = False,
        layers: int = L,
        heads: int = H,
        pages: int = 8,
        dtype: torch.dtype = torch.bfloat16,
        start_layer: int = 0,
    ) -> None:
        self.layout = layout
        self.page_size = P
        self.dtype = dtype
        self.layer_num = layers
        self.start_layer = start_layer
        self.end_layer = start_layer + layers
        self.size = pages * P
        self.mla = mla
        if mla:
            self.kv_cache_dim = D
            heads = 1
        else:
            self.head_num = heads
            self.head_dim = D
        shape = PoolLayout(layout, "mla" if mla else "mha", layers, heads, D, P, pages).shape  # type: ignore[arg-type]
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    # the oracle: one page as [planes, layers, P, heads, D] (MLA: [1, layers, P, 1, D])
    def _page(self, page: int) -> torch.Tensor:
        kv = self.kv_buffer if not self.mla else self.kv_buffer.unsqueeze(0)
        s = slice(page * P, (page + 1) * P)
        if self.layout == "layer_first":
            return kv[:, :, s]
        if self.layout == "page_first":
            return kv[:, s].permute(0, 2, 1, 3, 4)
        if self.layout == "page_first_direct":
            return kv[:, page]
        return kv[:, page].permute(0, 3, 2, 1, 4)  # page_head: [2, H, P, L, D]

    def put(self, page: int, data: torch.Tensor) -> None:
        self._page(page).copy_(data)

    def take(self, page: int) -> torch.Tensor:
        return self._page(page).clone()

    # SGLang's generic path (HostKVCache.get_data_page & co., same semantics)
    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = int(index) // P
        kv = self.kv_buffer
        if self.layout in ("layer_first",):
            data = kv[:, :, index : index + P] if not self.mla else kv[:, index : index + P]
        elif self.layout == "page_first":
            data = kv[:, index : index + P] if not self.mla else kv[index : index + P]
        else:
            data = kv[:, page : page + 1] if not self.mla else kv[page : page + 1]
        return data.flatten() if flat else data

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.get_data_page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))


def make_config(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                mla: bool = False, model: str = "org/model", **extra: Any) -> Any:
    fields = {
        "tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank, "pp_size": pp_size, "attn_cp_rank": 0,
        "attn_cp_size": 1, "is_mla_model": mla, "enable_storage_metrics": False,
        "is_page_first_layout": True, "model_name": model,
        "extra_config": {"backend_name": "hicache_store",
                      "module_path": "hicache_store.integrations.sglang",
                      "class_name": "HiCacheStoreStorage", "interface_v1": 1, **extra},
    }
    if SGLANG_AVAILABLE:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        return HiCacheStorageConfig(**fields)
    return SimpleNamespace(**fields)


def adapter(pool: StandInPool, **kw: Any) -> HiCacheStoreStorage:
    store = HiCacheStoreStorage(make_config(**kw), {})
    store.register_mem_pool_host(pool)
    return store


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def random_pages(n: int, *, mla: bool = False, layers: int = L, heads: int = H,
                 dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n * 7 + layers)
    shape = (1, layers, P, 1, D) if mla else (2, layers, P, heads, D)
    return [torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(dtype)
            if dtype.itemsize == 2 else torch.randn(shape, generator=g).to(dtype)
            for _ in range(n)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (random bit patterns include NaNs, which ``==`` never matches)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'kv'}"


# -- SGLang's own loader and classes ----------------------------------------------------------


@needs_sglang
def test_loads_through_storage_backend_factory(url: str) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = StandInPool("page_first")
    store = StorageBackendFactory.create_backend("dynamic", make_config(url=url), pool)
    assert isinstance(store, HiCacheStoreStorage)
    assert isinstance(store, HiCacheStorage)
    store.register_mem_pool_host(pool)  # what the controller does next
    keys = keys_for(2)
    for i, data in enumerate(random_pages(2)):
        pool.put(i, data)
    assert store.batch_set_v1(keys, slots([0, 1])) == [True, True]
    assert store.batch_exists(keys) == 2
    store.close()


@needs_sglang
def test_stand_in_matches_sglang_source() -> None:
    """Every attribute the adapter reads is one SGLang's pools set, with the shapes we assume."""
    import sglang.srt.mem_cache as mem_cache

    root = Path(mem_cache.__path__[0]) / "pool_host"
    sources = {name: ast.parse((root / f"{name}.py").read_text()) for name in ("base", "mha", "mla")}

    def assigned(tree: ast.Module, cls: str) -> set[str]:
        (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
        return {
            t.attr for a in ast.walk(node) if isinstance(a, ast.Assign | ast.AnnAssign)
            for t in (a.targets if isinstance(a, ast.Assign) else [a.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }

    base = assigned(sources["base"], "HostKVCache")
    for kind, module, cls in (("mha", "mha", "MHATokenToKVPoolHost"),
                              ("mla", "mla", "MLATokenToKVPoolHost")):
        have = base | assigned(sources[module], cls)
        assert set(HOST_POOL_ATTRIBUTES[kind]) <= have, set(HOST_POOL_ATTRIBUTES[kind]) - have
        assert "start_layer" in have

    # init_kv_buffer's dims per layout, evaluated, equal the layout layer's shapes
    values = {"layer_num": 3, "size": 5 * P, "page_num": 5, "page_size": P, "head_num": 2,
              "head_dim": D, "kv_cache_dim": D}
    for kind, module, cls, layouts in (("mha", "mha", "MHATokenToKVPoolHost", MHA_LAYOUTS),
                                       ("mla", "mla", "MLATokenToKVPoolHost", MLA_LAYOUTS)):
        (klass,) = [n for n in ast.walk(sources[module])
                    if isinstance(n, ast.ClassDef) and n.name == cls]
        (init,) = [n for n in klass.body
                   if isinstance(n, ast.FunctionDef) and n.name == "init_kv_buffer"]
        dims: dict[str, tuple[int, ...]] = {}
        for node in ast.walk(init):
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.comparators[0], ast.Constant)):
                name = node.test.comparators[0].value
                for stmt in node.body:
                    if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Tuple)
                            and getattr(stmt.targets[0], "id", None) == "dims"):
                        dims[name] = tuple(
                            e.value if isinstance(e, ast.Constant) else values[e.attr]  # type: ignore[attr-defined]
                            for e in stmt.value.elts
                        )
        for layout in layouts:
            heads = 2 if kind == "mha" else 1
            want = PoolLayout(layout, kind, 3, heads, D, P, 5).shape  # type: ignore[arg-type]
            assert dims[layout] == want, (kind, layout, dims.get(layout), want)


def test_works_without_sglang() -> None:
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import hicache_store.integrations.sglang as m\n"
        "assert not m.SGLANG_AVAILABLE and m.HiCacheStoreStorage.__mro__[1] is object\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- every layout, MHA and MLA ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "mla"), [(lay, False) for lay in MHA_LAYOUTS] + [(lay, True) for lay in MLA_LAYOUTS]
)
def test_roundtrip_every_layout(url: str, layout: str, mla: bool) -> None:
    src = StandInPool(layout, mla=mla)
    dst = StandInPool(layout, mla=mla)
    data = random_pages(3, mla=mla)
    for page, d in zip([5, 1, 6], data, strict=True):
        src.put(page, d)
    keys = keys_for(3)
    w = adapter(src, url=url, mla=mla)
    assert w.batch_set_v1(keys, slots([5, 1, 6])) == [True] * 3
    r = adapter(dst, url=url, mla=mla)
    assert r.batch_exists(keys + keys_for(1, "other")) == 3
    assert r.batch_get_v1(keys, slots([0, 7, 3])) == [True] * 3
    for page, d in zip([0, 7, 3], data, strict=True):
        assert same(dst.take(page), d)
    untouched = [p for p in range(8) if p not in (0, 7, 3)]
    assert all(not dst.take(p).view(torch.int16).any() for p in untouched)


def test_chunks_and_layouts_interoperate(url: str) -> None:
    """Tiny staging (one page per chunk) and a writer/reader pair of different layouts."""
    src = StandInPool("page_head", pages=16)
    dst = StandInPool("layer_first", pages=16)
    data = random_pages(10)
    for i, d in enumerate(data):
        src.put(i, d)
    keys = keys_for(10)
    tiny = {"staging_mib": 0.001}
    assert adapter(src, url=url, **tiny).batch_set_v1(keys, slots(list(range(10)))) == [True] * 10
    got = adapter(dst, url=url, **tiny).batch_get_v1(keys, slots(list(range(6, 16))))
    assert got == [True] * 10
    for i, d in enumerate(data):
        assert same(dst.take(6 + i), d)


# -- cross topology ------------------------------------------------------------------------------


def full_pages(n: int) -> list[torch.Tensor]:
    return random_pages(n)


@pytest.mark.parametrize("grid_keys", [{"grid": "4x2"}, "share"])
def test_tp2_writers_tp1_reader(url: str, grid_keys: Any) -> None:
    data = full_pages(4)
    keys = keys_for(4)
    for tp_rank in range(2):
        pool = StandInPool("page_first", heads=H // 2)
        for i, d in enumerate(data):
            pool.put(i, d[:, :, :, tp_rank * 2 : tp_rank * 2 + 2])
        extra = grid_keys if grid_keys != "share" else {"share_with": ["tp=1,pp=1"]}
        w = adapter(pool, url=url, tp_rank=tp_rank, tp_size=2, **extra)
        assert w.batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
    reader_pool = StandInPool("page_head")
    extra = grid_keys if grid_keys != "share" else {"share_with": ["tp=2,pp=1"]}
    r = adapter(reader_pool, url=url, **extra)
    assert r.batch_exists(keys) == 4
    assert r.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True] * 4
    for i, d in enumerate(data):
        assert same(reader_pool.take(4 + i), d)
    # and a TP2 rank reads its head slice of what TP1 would write (same objects)
    half = StandInPool("layer_first", heads=H // 2)
    extra = grid_keys if grid_keys != "share" else {"share_with": ["tp=1,pp=1"]}
    r1 = adapter(half, url=url, tp_rank=1, tp_size=2, **extra)
    assert r1.batch_get_v1(keys, slots([0, 1, 2, 3])) == [True] * 4
    for i, d in enumerate(data):
        assert same(half.take(i), d[:, :, :, 2:4])


def test_only_one_rank_written_is_a_miss_for_tp1(url: str) -> None:
    data = full_pages(2)
    pool = StandInPool("page_first", heads=H // 2)
    for i, d in enumerate(data):
        pool.put(i, d[:, :, :, :2])
    adapter(pool, url=url, tp_size=2, grid="4x2").batch_set_v1(keys_for(2), slots([0, 1]))
    r = adapter(StandInPool("page_first"), url=url, grid="4x2")
    assert r.batch_exists(keys_for(2)) == 0
    assert r.batch_get_v1(keys_for(2), slots([0, 1])) == [False, False]


def test_pp2_stages_pp1_reader(url: str) -> None:
    data = full_pages(3)
    keys = keys_for(3)
    for pp_rank in range(2):
        pool = StandInPool("page_first_direct", layers=L // 2, start_layer=pp_rank * 2)
        for i, d in enumerate(data):
            pool.put(i, d[:, pp_rank * 2 : pp_rank * 2 + 2])
        w = adapter(pool, url=url, pp_rank=pp_rank, pp_size=2, num_layers=L, grid="2x4")
        assert w.batch_set_v1(keys, slots([0, 1, 2])) == [True] * 3
    dst = StandInPool("page_first")
    r = adapter(dst, url=url, grid="2x4")
    assert r.batch_get_v1(keys, slots([2, 3, 4])) == [True] * 3
    for i, d in enumerate(data):
        assert same(dst.take(2 + i), d)


def test_uneven_pp_follows_sglangs_stage_split(url: str) -> None:
    """5 layers on 2 stages: SGLang gives the extra layer to the last stage ([2, 3])."""
    data = random_pages(2, layers=5)
    keys = keys_for(2, "uneven")
    for pp_rank, (start, count) in enumerate(((0, 2), (2, 3))):
        pool = StandInPool("page_first", layers=count, start_layer=start)
        for i, d in enumerate(data):
            pool.put(i, d[:, start : start + count])
        w = adapter(pool, url=url, pp_rank=pp_rank, pp_size=2, num_layers=5, grid="1x4")
        assert w.batch_set_v1(keys, slots([0, 1])) == [True, True]
    dst = StandInPool("page_head", layers=5)
    r = adapter(dst, url=url, grid="1x4")
    assert r.batch_get_v1(keys, slots([3, 4])) == [True, True]
    for i, d in enumerate(data):
        assert same(dst.take(3 + i), d)


def test_pp_without_num_layers_is_refused_at_registration(url: str) -> None:
    store = HiCacheStoreStorage(make_config(pp_size=2, url=url), {})
    with pytest.raises(ValueError, match="num_layers"):
        store.register_mem_pool_host(StandInPool("page_first", layers=2))


def test_mla_rank0_writes_every_rank_reads(url: str, tmp_path: Path) -> None:
    data = random_pages(3, mla=True)
    keys = keys_for(3)
    stores = []
    for tp_rank in range(2):
        pool = StandInPool("page_first", mla=True)
        for i, d in enumerate(data):
            pool.put(i, d)
        stores.append(adapter(pool, url=url, tp_rank=tp_rank, tp_size=2, mla=True))
    assert stores[1].batch_set_v1(keys, slots([0, 1, 2])) == [True] * 3  # not its to write
    assert stores[1].batch_exists(keys) == 0
    assert stores[0].batch_set_v1(keys, slots([0, 1, 2])) == [True] * 3
    objects = [p for p in (tmp_path / "kv" / "objects").rglob("*")
               if p.is_file() and not p.name.startswith("M_")]  # M_: the namespace manifest
    assert len(objects) == 3
    for tp_rank, lay in ((0, "layer_first"), (1, "page_first_direct"), (1, "layer_first")):
        dst = StandInPool(lay, mla=True)
        r = adapter(dst, url=url, tp_rank=tp_rank, tp_size=2, mla=True)
        assert r.batch_get_v1(keys, slots([5, 6, 7])) == [True] * 3
        for i, d in enumerate(data):
            assert same(dst.take(5 + i), d)
    # a TP1 MLA deployment shares them too
    assert adapter(StandInPool("page_first", mla=True), url=url, mla=True).batch_exists(keys) == 3


@pytest.mark.parametrize(
    "reader",
    [
        {"dtype": torch.float16},
        {"extra": {"tenant_salt": "tenant-b"}},
        {"extra": {"model": "org/other-model"}},
        {"extra": {"grid": "2x2"}},
    ],
    ids=["dtype", "salt", "model", "grid"],
)
def test_namespace_mismatch_is_a_miss(url: str, reader: dict[str, Any]) -> None:
    src = StandInPool("page_first")
    src.put(0, random_pages(1)[0])
    keys = keys_for(1)
    assert adapter(src, url=url).batch_set_v1(keys, slots([0])) == [True]
    dst = StandInPool("page_first", dtype=reader.get("dtype", torch.bfloat16))
    r = adapter(dst, url=url, **reader.get("extra", {}))
    assert r.batch_exists(keys) == 0
    assert r.batch_get_v1(keys, slots([1])) == [False]
    assert not dst.kv_buffer.view(torch.int16).any()


# -- the generic path, failures, threads ----------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_generic_path_as_the_controller_drives_it(url: str, layout: str) -> None:
    src = StandInPool(layout)
    data = random_pages(2)
    for i, d in enumerate(data):
        src.put(i, d)
    keys = keys_for(2)
    w = adapter(src, url=url)
    assert w.batch_set(keys, [src.get_data_page(i * P) for i in range(2)])
    assert w.exists(keys[0])
    dst = StandInPool(layout)
    r = adapter(dst, url=url)
    pages = r.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(pages):
        assert page is not None
        dst.set_from_flat_data_page((3 + i) * P, page)
        assert same(dst.take(3 + i), data[i])
    got = r.get(keys[1])
    assert got is not None
    assert r.get(keys_for(1, "absent")[0]) is None
    assert r.batch_get_v1(keys, slots([6, 7])) == [True, True]  # same objects as v1


def test_failures_never_raise(url: str, tmp_path: Path) -> None:
    pool = StandInPool("page_first")
    unregistered = HiCacheStoreStorage(make_config(url=url), {})
    assert unregistered.batch_exists(keys_for(1)) == 0
    assert unregistered.batch_get_v1(keys_for(1), slots([0])) == [False]
    store = adapter(pool, url=url)
    assert store.batch_set_v1(["not-a-hash"], slots([0])) == [False]
    assert store.batch_set_v1(keys_for(2), slots([0])) == [False, False]  # wrong index count
    assert store.batch_get_v1(keys_for(1), torch.tensor([10**6] * P)) == [False]
    assert store.batch_get([keys_for(1)[0]]) == [None]
    assert not store.batch_set(keys_for(1), None)
    # a corrupt object is a miss, counted
    pool.put(0, random_pages(1)[0])
    assert store.batch_set_v1(keys_for(1, "c"), slots([0])) == [True]
    (obj,) = list((tmp_path / "kv" / "objects").rglob(keys_for(1, "c")[0] + "*"))
    raw = bytearray(obj.read_bytes())
    raw[-1] ^= 0xFF
    obj.write_bytes(bytes(raw))
    assert store.batch_get_v1(keys_for(1, "c"), slots([1])) == [False]
    counters = store.counters
    assert counters["corrupt_objects"] == 1
    assert counters["set_errors"] >= 2
    store.close()
    assert store.batch_exists(keys_for(1, "c")) == 0
    assert store.batch_set_v1(keys_for(1), slots([0])) == [False]


def test_read_window_reports_each_page_and_leaves_failed_slots_alone(
    url: str, tmp_path: Path
) -> None:
    # Staging for three rows: ten pages stream through a window of 3, with a missing page
    # and a corrupt one inside it; the rest must land exactly, those two slots keep their bytes.
    pool = StandInPool("page_first", pages=24)
    store = adapter(pool, url=url, staging_mib=3 * 4096 / 2**20)
    data = random_pages(10)
    for i, d in enumerate(data):
        pool.put(i, d)
    keys = keys_for(10, "window")
    assert store.batch_set_v1(keys, slots(list(range(10)))) == [True] * 10
    objects = tmp_path / "kv" / "objects"
    (gone,) = list(objects.rglob(keys[4] + "*"))
    gone.unlink()
    (bad,) = list(objects.rglob(keys[7] + "*"))
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    bad.write_bytes(bytes(raw))
    (before,) = random_pages(1)
    for i in range(10):
        pool.put(12 + i, before)
    got = store.batch_get_v1(keys, slots(list(range(12, 22))))
    assert got == [i not in (4, 7) for i in range(10)]
    for i in range(10):
        assert same(pool.take(12 + i), before if i in (4, 7) else data[i]), i
    assert store.counters["corrupt_objects"] == 1


def test_read_window_is_made_at_registration(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import hicache_store.objects.arena as module  # where the adapter's staging is made

    pool = StandInPool("page_first", pages=8)
    store = adapter(pool, url=url)
    data = random_pages(2)
    for i, d in enumerate(data):
        pool.put(i, d)
    keys = keys_for(2, "made")
    assert store.batch_set_v1(keys, slots([0, 1])) == [True, True]
    made: list[tuple[int, bool]] = []
    real = module.aligned_buffer

    def counting(nbytes: int, *, populate: bool = False) -> memoryview:
        made.append((nbytes, populate))
        return real(nbytes, populate=populate)

    monkeypatch.setattr(module, "aligned_buffer", counting)
    results: list[list[bool]] = []
    reader = threading.Thread(  # SGLang prefetches from its own thread
        target=lambda: results.append(store.batch_get_v1(keys, slots([4, 5])))
    )
    reader.start()
    reader.join()
    assert results == [[True, True]]
    # (only read windows are populated: the header slots the reads also take are not)
    assert [m for m in made if m[1]] == []  # the window made at registration was adopted
    assert same(pool.take(4), data[0]) and same(pool.take(5), data[1])
    # a second reading thread makes its own (populated) window
    again = threading.Thread(target=lambda: results.append(store.batch_get_v1(keys, slots([6, 7]))))
    again.start()
    again.join()
    assert results[1] == [True, True]
    assert len([m for m in made if m[1]]) == 1


def test_threads_share_one_adapter(url: str) -> None:
    pool = StandInPool("page_first", pages=32)
    store = adapter(pool, url=url, staging_mib=0.002)
    data = random_pages(16)
    for i, d in enumerate(data):
        pool.put(i, d)
    keys = keys_for(16)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            mine = list(range(t * 4, t * 4 + 4))
            for _ in range(3):
                assert store.batch_set_v1([keys[i] for i in mine], slots(mine)) == [True] * 4
                assert store.batch_exists([keys[i] for i in mine]) == 4
                assert store.batch_get_v1([keys[i] for i in mine], slots([16 + i for i in mine])) == [True] * 4
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, d in enumerate(data):
        assert same(pool.take(16 + i), d)
    stats = store.get_stats()
    assert sum(stats.backup_pgs) == 48 and sum(stats.prefetch_pgs) == 48
    assert store.get_stats().backup_pgs == []  # drained


def test_clear_removes_only_this_namespace(url: str) -> None:
    pool = StandInPool("page_first")
    pool.put(0, random_pages(1)[0])
    a = adapter(pool, url=url, allow_clear=True)
    b = adapter(pool, url=url, tenant_salt="b")
    keys = keys_for(1)
    assert a.batch_set_v1(keys, slots([0])) == [True]
    assert b.batch_set_v1(keys, slots([0])) == [True]
    a.clear()
    assert a.batch_exists(keys) == 0
    assert b.batch_exists(keys) == 1


def test_config_errors_raise_at_startup(url: str) -> None:
    with pytest.raises(ValueError, match="url"):
        HiCacheStoreStorage(make_config(), {})
    store = HiCacheStoreStorage(make_config(url=url), {})
    pool = StandInPool("page_first", dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_dtype"):
        store.register_mem_pool_host(pool)
    for spelling in ("float8_e4m3fn", "fp8_e4m3"):  # torch's name, SGLang's --kv-cache-dtype
        store = HiCacheStoreStorage(make_config(url=url, kv_dtype=spelling), {})
        with pytest.raises(ValueError, match="kv_scales"):  # float8 KV needs its scales
            store.register_mem_pool_host(pool)
        store = HiCacheStoreStorage(
            make_config(url=url, kv_dtype=spelling, kv_scales={"k": 0.5, "v": 0.25}), {})
        store.register_mem_pool_host(pool)
        assert store.namespace is not None and store.namespace.dtype == "float8_e4m3fn"
        assert store.namespace.kv_scales == kv_scales_digest([0.5] * L, [0.25] * L)
    for bad in ({"k": 1.0}, {"k": "1", "v": 1.0}, [1.0, 1.0], {"k": [], "v": []}):
        with pytest.raises(ValueError, match="kv_scales"):
            HiCacheStoreStorage(make_config(url=url, kv_dtype="fp8_e4m3", kv_scales=bad), {})
    assert importlib.util.find_spec("hicache_store.integrations.sglang") is not None


def test_writes_stay_within_the_byte_budget(tmp_path: Path) -> None:
    # 400 pages of 6 KiB frames into a slow store, at most 128 KiB in flight (less than the
    # puts of ObjectIO's PUT_WINDOW, so the budget is what binds).
    pool = StandInPool("page_first", pages=400)
    url = f"faulty://?inner=file://{tmp_path / 'kv'}&latency_s=0.02"
    store = adapter(pool, url=url, max_inflight_mib=0.125)
    budget = store._registered.link.io.write_budget  # type: ignore[union-attr]
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, budget.used)
            done.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert store.batch_set_v1(keys_for(400), slots(list(range(400)))) == [True] * 400
    finally:
        done.set()
        watcher.join()
    assert (1 << 17) // 2 < peak <= 1 << 17
    store.close()


def test_a_misspelled_extra_config_key_is_an_error(url: str) -> None:
    # "tenant-salt" once only warned, and the tenant joined the shared unsalted namespace.
    with pytest.raises(ValueError, match=r"unknown key 'tenant-salt' \(did you mean 'tenant_salt'\?\)"):
        HiCacheStoreStorage(make_config(url=url, **{"tenant-salt": "acme"}), {})
    with pytest.raises(ValueError, match=r"unknown keys 'gird' \(did you mean 'grid'\?\), 'zzz'"):
        HiCacheStoreStorage(make_config(url=url, gird="1x1", zzz=1), {})
    # SGLang's own keys (popped or read by SGLang) stay accepted.
    HiCacheStoreStorage(make_config(url=url, prefetch_threshold=64, tp_lcm_size=2), {}).close()


@pytest.mark.parametrize(("tp", "share_with"), [(1, []), (2, []), (2, ["tp=1,pp=2"]), (4, [])])
def test_adapter_and_operator_tools_derive_the_same_namespace(
    url: str, tp: int, share_with: list[str]
) -> None:
    # prepopulate and doctor describe a deployment with ops.deployment; the adapter must land
    # on the same namespace from the same inputs, or a prepopulated store never hits.
    from hicache_store.layout.namespace import ModelShape
    from hicache_store.layout.topology import Topology
    from hicache_store.ops.deployment import Deployment, parse_adapter_config

    extra = {"share_with": share_with, "tenant_salt": "t1"} if share_with else {}
    store = adapter(StandInPool("page_first", heads=H // tp), url=url, tp_size=tp, **extra)
    deployment = Deployment(config=parse_adapter_config(extra), model_id="org/model",
                            dtype="bfloat16", page_size=P, topology=Topology(tp, 1))
    assert store.namespace == deployment.namespace(ModelShape.mha(L, H, D))
    store.close()


def test_namespace_reported_at_start_and_manifest_written(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from hicache_store import sync
    from hicache_store.ops.manifest import list_manifests

    pool = StandInPool("page_first")
    with caplog.at_level("INFO", logger="hicache_store.integrations.sglang"):
        first = adapter(pool, url=url)
        second = adapter(pool, url=url)
    infos = [r.getMessage() for r in caplog.records if "namespace" in r.getMessage()]
    assert "manifest stored now in the store" in infos[0]
    assert "manifest stored in the store" in infos[1]
    assert first.namespace is not None
    assert sync.run(list_manifests(first.backend)) == [f"M_{first.namespace.digest}"]
    first.close()
    second.close()


def test_keeps_missing_while_the_store_holds_the_model_warns_once(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from hicache_store.integrations.sglang._namespace import MISSES_BEFORE_CHECK

    pool = StandInPool("page_first")
    pool.put(0, random_pages(1)[0])
    writer = adapter(pool, url=url, model="org/model")
    assert writer.batch_set_v1(keys_for(1), slots([0])) == [True]
    # The same model served by its path, as SGLang names it by default: another namespace.
    reader = adapter(pool, url=url, model="/models/org-model")
    with caplog.at_level("WARNING", logger="hicache_store.integrations.sglang"):
        for _ in range(MISSES_BEFORE_CHECK + 5):
            assert reader.batch_exists(keys_for(1)) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "found nothing" in r.getMessage()]
    assert f"{MISSES_BEFORE_CHECK} lookups" in warning
    assert "model: deployment /models/org-model, stored org/model" in warning
    assert "hicache-store doctor" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="hicache_store.integrations.sglang"):
        for _ in range(MISSES_BEFORE_CHECK + 1):  # a deployment that hits never warns
            assert writer.batch_exists(keys_for(1)) == 1
            assert writer.batch_exists(keys_for(3, salt="new")) == 0
    assert not [r for r in caplog.records if "found nothing" in r.getMessage()]
    writer.close()
    reader.close()


@pytest.mark.slow
def test_reads_abandoned_in_flight_never_reach_the_pool() -> None:
    # Issue 17 through the adapter: L3 reads land 0-40 ms after they start, from I/O the
    # caller cannot stop, against a 15 ms deadline; a two-row read window is reused page
    # after page. A page reported True must hold exactly its data, a page reported False
    # must keep the slot's old bytes: never another page's late bytes.
    from hicache_store.backends.faulty import FaultConfig, FaultyBackend

    # The in-process store keeps every step on the event loop, so what makes a read late or
    # in time is only the injected landing time against the deadline (both loop timers).
    pool = StandInPool("page_first", pages=64)
    data = random_pages(24)
    for i, d in enumerate(data):
        pool.put(i, d)
    keys = keys_for(24, "late")
    store = adapter(
        pool, url="faulty://?inner=memory://", io_timeout_s=0.015,
        staging_mib=2 * 4096 / 2**20,
    )
    assert isinstance(store.backend, FaultyBackend)
    assert store.batch_set_v1(keys, slots(list(range(24)))) == [True] * 24
    store.backend.faults = FaultConfig(seed=4, inflight_latency_s=0.0, inflight_jitter_s=0.04)
    (before,) = random_pages(1, heads=H, layers=L)
    outcomes: list[bool] = []
    for _round in range(12):
        for i in range(24):
            pool.put(32 + i, before)
        got = store.batch_get_v1(keys, slots(list(range(32, 56))))
        for i in range(24):
            assert same(pool.take(32 + i), data[i] if got[i] else before), (i, got[i])
        outcomes.extend(got)
    assert any(outcomes) and not all(outcomes), "the deadline never split the reads"
    assert store.backend.injected["inflight_read"] > 0
    store.close()


@pytest.mark.slow
def test_logits_equal_a_recompute_when_reads_outlive_their_deadline(tmp_path: Path) -> None:
    # Issue 17 end to end through the adapter: a model's KV stored page by page, then many
    # requests whose prefix pages are read into the same few host rows (SGLang reuses a row
    # as soon as the adapter reports on it) while each read lands 0-40 ms after it starts
    # against a 15 ms deadline. The engine prefills the suffix over the pages reported
    # True: its logits must equal a full recompute every time, whatever was abandoned.
    import random

    from hicache_store.backends.faulty import FaultConfig, FaultyBackend
    from hicache_store.demo.engine.config import MiniLlamaConfig
    from hicache_store.demo.engine.kv_pool import DeviceKVPool
    from hicache_store.demo.engine.model import MiniLlama

    model = MiniLlama(MiniLlamaConfig(num_layers=L, num_heads=H, num_kv_heads=H, head_dim=D))
    rng = random.Random(17)
    system = [rng.randrange(512) for _ in range(5 * P)]
    prompts = [system + [rng.randrange(512) for _ in range(rng.randrange(1, 4) * P + 2)]
               for _ in range(6)]

    def page_keys(tokens: list[int]) -> list[str]:
        return [hashlib.sha256(repr(tokens[: (i + 1) * P]).encode()).hexdigest()
                for i in range(len(tokens) // P)]

    def page_of(dev: DeviceKVPool, page: int) -> torch.Tensor:  # [2, L, P, H, D]
        s = dev.slots_of([page])
        return torch.stack([torch.stack([buf[s] for buf in bufs])
                            for bufs in (dev.k_buffers, dev.v_buffers)])

    rows = 12  # host rows: every request reads into the same ones
    host = StandInPool("page_first", pages=rows, dtype=torch.float32)
    # The writer stores every page under a deadline no load can miss: what this test
    # varies is the reads' deadline, not whether the writes made theirs.
    writer = adapter(host, url=f"file://{tmp_path / 'kv'}", io_timeout_s=60.0)
    for tokens in prompts:  # the writer: prefill, then each full page through the host pool
        dev = DeviceKVPool.for_model(model.config, num_pages=rows, page_size=P)
        pages = dev.alloc(-(-len(tokens) // P))
        model.prefill(torch.tensor(tokens), 0, dev.slots_of(pages)[: len(tokens)], dev)
        keys = page_keys(tokens)
        for i in range(len(keys)):
            host.put(i, page_of(dev, pages[i]))
        assert writer.batch_set_v1(keys, slots(list(range(len(keys))))) == [True] * len(keys)
    writer.close()

    store = adapter(host, url=f"faulty://?inner=file://{tmp_path / 'kv'}", io_timeout_s=0.015,
                    staging_mib=2 * host.take(0).numel() * 4 / 2**20)
    assert isinstance(store.backend, FaultyBackend)
    store.backend.faults = FaultConfig(seed=6, inflight_latency_s=0.0, inflight_jitter_s=0.04)
    hits: list[int] = []
    for _round in range(4):
        for tokens in prompts:
            keys = page_keys(tokens)
            got = store.batch_get_v1(keys, slots(list(range(len(keys)))))
            hit = next((i for i, ok in enumerate(got) if not ok), len(got))
            hit = min(hit, (len(tokens) - 1) // P)  # at least one token to compute
            dev = DeviceKVPool.for_model(model.config, num_pages=rows, page_size=P)
            pages = dev.alloc(-(-len(tokens) // P))
            for i in range(hit):  # the engine loads the pages reported True
                s = dev.slots_of([pages[i]])
                page = host.take(i)
                for layer in range(L):
                    dev.k_buffers[layer][s] = page[0, layer]
                    dev.v_buffers[layer][s] = page[1, layer]
            start = hit * P
            logits = model.prefill(torch.tensor(tokens[start:]), start,
                                   dev.slots_of(pages)[: len(tokens)], dev)
            expected = model.forward_full(torch.tensor(tokens))[start:]
            assert torch.equal(logits, expected), f"wrong KV reached the engine ({hit} pages)"
            hits.append(hit)
    assert any(hits) and min(hits) < max(hits), "the deadline never split the reads"
    assert store.backend.injected["inflight_read"] > 0
    store.close()
