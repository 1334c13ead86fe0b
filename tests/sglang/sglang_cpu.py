"""SGLang 0.5.23's own storage-side classes, driven on CPU.

SGLang's controller and host pools import on a CPU machine once a handful of modules that are
*not on the storage path* are replaced by empty stubs at import time (a ``sys.meta_path``
finder): all-reduce kernels (``tvm_ffi``), the multimodal and OCR configs that import
torchvision or sentencepiece, the GGUF and compressed-tensors quantization packages. Every
attribute taken from a stub is recorded (``STUB_USES``); tests assert that nothing touches a
stub after import, so the code under test is SGLang's, not ours.

``Rank`` builds one scheduler rank's storage side out of SGLang's real classes: a CPU device
pool (``MHATokenToKVPool`` / ``MLATokenToKVPool``), the host pool SGLang derives from it
(``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) inside a ``HostPoolGroup``, and the
``HybridCacheController`` that a 0.5.23 ``UnifiedRadixCache`` uses for plain MHA/MLA models,
attached to our backend through SGLang's ``StorageBackendFactory`` ("dynamic"). The test
plays the radix tree's side of the protocol only: it fills host pages, asks the controller to
back them up, starts prefetches, allocates the host slots of a hit and hands the operation to
the controller's I/O thread, exactly as ``UnifiedRadixCache`` does. SGLang's own threads make
every storage call.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

#: modules replaced by stubs (a name covers its submodules). None is on the storage path.
STUBBED = (
    "tvm_ffi",  # custom all-reduce kernels
    "compressed_tensors",  # a quantization package imported by quantization configs
    "sglang.srt.multimodal.internvl_utils",  # torchvision
    "sglang.srt.configs.deepseek_ocr",  # torchvision
    "sglang.srt.configs.internvl",  # sentencepiece
    "sglang.srt.utils.hf_transformers.common",  # processor registry
    "sglang.srt.layers.quantization.gguf",  # gguf
)
#: every (stub, attribute) taken from a stub, in order.
STUB_USES: list[tuple[str, str]] = []


class _StubMeta(type):
    """Anything taken from a stub: a class that records every further use of it."""

    def __getattr__(cls, name: str) -> Any:
        STUB_USES.append((cls.__qualname__, name))
        return _stub(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        STUB_USES.append((cls.__qualname__, "()"))
        return _stub(f"{cls.__qualname__}()")

    def __getitem__(cls, item: Any) -> Any:
        STUB_USES.append((cls.__qualname__, "[]"))
        return cls


def _stub(name: str) -> type:
    return _StubMeta(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        STUB_USES.append((self.__name__, name))
        return _stub(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if any(fullname == s or fullname.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_FINDER = _StubFinder()
#: SGLang modules the tests use; imported once, with the stubs in place.
MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.hicache_key_scheme",
    "sglang.srt.observability.metrics_collector",
)


class _Loaded:
    modules: ClassVar[dict[str, Any]] = {}
    error: str | None = None
    #: stub uses that happened while importing (allowed; any later one is not).
    uses_at_import = 0


def load() -> str | None:
    """Import SGLang's modules with the stubs installed; None, or why they do not import."""
    if _Loaded.modules or _Loaded.error is not None:
        return _Loaded.error
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    try:
        for name in MODULES:
            _Loaded.modules[name] = importlib.import_module(name)
    except Exception as exc:  # not installed, or a new release imports something else
        _Loaded.error = f"{type(exc).__name__}: {exc}"
        _Loaded.modules.clear()
    _Loaded.uses_at_import = len(STUB_USES)
    return _Loaded.error


@contextmanager
def imported() -> Iterator[types.ModuleType]:
    """The body of the ``sglang`` test fixtures: this module with SGLang imported (skips the
    test, with the reason, where it cannot import); afterwards, no stub may have been touched:
    the code that ran is SGLang's own."""
    import pytest

    error = load()
    if error is not None:
        pytest.skip(f"SGLang 0.5.23 does not import here ({error}); see `make setup`")
    before = len(stub_uses_since_import())
    yield sys.modules[__name__]
    assert stub_uses_since_import()[before:] == []


def module(name: str) -> Any:
    """One of ``MODULES`` (``load()`` first)."""
    return _Loaded.modules[name]


def module_any(name: str) -> Any:
    """Any other SGLang module (imported with the stubs in place; ``load()`` first)."""
    if name not in _Loaded.modules:
        _Loaded.modules[name] = importlib.import_module(name)
    return _Loaded.modules[name]


def stub_uses_since_import() -> list[tuple[str, str]]:
    """Stub attributes used after SGLang was imported (must stay empty)."""
    return STUB_USES[_Loaded.uses_at_import :]


# -- one rank --------------------------------------------------------------------------------


def parallel_state(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> Any:
    """What SGLang's ``get_parallel()`` answers for one rank (the fields storage reads)."""
    return SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_tp_rank=tp_rank,
        attn_tp_size=tp_size,
        attn_dp_rank=0,
        attn_dcp_size=1,
        attn_dcp_rank=0,
        dcp_enabled=False,
    )


@contextmanager
def as_rank(parallel: Any) -> Iterator[None]:
    """Answer SGLang's parallel-state lookups as ``parallel`` (the controller reads them when
    it attaches a backend)."""
    cc = module("sglang.srt.managers.cache_controller")
    saved = cc.get_parallel, cc.is_dp_attention_enabled
    cc.get_parallel = lambda: parallel
    cc.is_dp_attention_enabled = lambda: False
    try:
        yield
    finally:
        cc.get_parallel, cc.is_dp_attention_enabled = saved


class _Allocator:
    """The device allocator as the controller sees it (the device side is not under test)."""

    def __init__(self, device_pool: Any) -> None:
        self.device_pool = device_pool

    def get_kvcache(self) -> Any:
        return self.device_pool

    def set_hicache_transfer_done_event(self, *args: Any) -> None:
        pass


@dataclass
class Geometry:
    """A small model: bytes are what count."""

    layers: int = 4
    heads: int = 4  # this rank's KV heads (MHA)
    head_dim: int = 8
    kv_dim: int = 16  # MLA latent dim (kv_lora_rank + rope dim)
    rope_dim: int = 4  # MLA rope dim (qk_rope_head_dim), the latent's last ``rope_dim``
    page_size: int = 4
    device_tokens: int = 64
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0


def extra_config(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend_name": "hicache_store",
        "module_path": "hicache_store.integrations.sglang",
        "class_name": "HiCacheStoreStorage",
        "interface_v1": 1,
        "url": url,
        **extra,
    }


#: host memory the test pools may book (they take a few KiB): SGLang checks a pool against the
#: machine's free memory less a 10 GB reserve, which a shared CI machine does not always have.
HOST_BUDGET = 1 << 30


@contextmanager
def host_budget() -> Iterator[None]:
    """Build host pools against ``HOST_BUDGET`` (SGLang's own ``host_memory_budget_scope``)."""
    base = module_any("sglang.srt.mem_cache.pool_host.base")
    with base.host_memory_budget_scope(HOST_BUDGET):
        yield


def kv_host_pool(geometry: Geometry, layout: str, *, mla: bool = False) -> tuple[Any, Any]:
    """(device pool, host pool) of SGLang's real classes for one rank."""
    with host_budget():
        return _kv_host_pool(geometry, layout, mla=mla)


def _kv_host_pool(geometry: Geometry, layout: str, *, mla: bool) -> tuple[Any, Any]:
    g = geometry
    memory_pool = module("sglang.srt.mem_cache.memory_pool")
    end = g.start_layer + g.layers
    common: dict[str, Any] = {"start_layer": g.start_layer, "end_layer": end}
    if mla:
        device = memory_pool.MLATokenToKVPool(
            size=g.device_tokens, page_size=g.page_size, dtype=g.dtype,
            kv_lora_rank=g.kv_dim - g.rope_dim, qk_rope_head_dim=g.rope_dim, layer_num=g.layers,
            device="cpu", enable_memory_saver=False, **common,
        )
        host = module("sglang.srt.mem_cache.pool_host.mla").MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, g.page_size, layout,
            pin_memory=False, device_capacity_tokens=device.size, target_layer_num=g.layers,
            **common,
        )
    else:
        device = memory_pool.MHATokenToKVPool(
            size=g.device_tokens, page_size=g.page_size, dtype=g.dtype, head_num=g.heads,
            head_dim=g.head_dim, layer_num=g.layers, device="cpu", enable_memory_saver=False,
            **common,
        )
        host = module("sglang.srt.mem_cache.pool_host.mha").MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, g.page_size, layout,
            pin_memory=False, device_capacity_tokens=device.size, **common,
        )
    return device, host


def mamba_host_pool(layers: int = 3, slots: int = 8, *, heads: int = 2, dim: int = 4,
                    conv: tuple[int, int] = (6, 3)) -> tuple[Any, Any]:
    """(device stand-in, SGLang's ``MambaPoolHost``) for one rank: float32 temporal (SSM)
    states of [heads, dim, dim] and one bfloat16 conv state of ``conv`` per layer, page size 1.
    The device side is a stand-in: the storage path never touches it."""
    info = module_any("sglang.srt.mem_cache.device_pool_info").MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, heads, dim, dim, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, *conv, dtype=torch.bfloat16),),
    )
    with host_budget():
        host = module_any("sglang.srt.mem_cache.pool_host.mamba").MambaPoolHost(
            info, 2.0, 0, device_capacity=slots, pin_memory=False, layout="page_first"
        )
    return SimpleNamespace(layer_num=layers), host


def host_page(host: Any, page: int, *, mla: bool = False) -> torch.Tensor:
    """Page ``page`` of an SGLang KV host pool as [planes, layers, P, heads, D] (a view), by
    plain indexing of its ``kv_buffer`` in its layout (the tests' oracle)."""
    p = host.page_size
    # MLA pools have no K/V axis and a head axis of 1: one plane of one head
    kv = host.kv_buffer if not mla else host.kv_buffer.unsqueeze(0)
    s = slice(page * p, (page + 1) * p)
    if host.layout == "layer_first":
        return kv[:, :, s]
    if host.layout == "page_first":
        return kv[:, s].permute(0, 2, 1, 3, 4)
    if host.layout == "page_first_direct":
        return kv[:, page]
    return kv[:, page].permute(0, 3, 2, 1, 4)  # page_head: [2, H, P, L, D]


def pool_entry(name: Any, host: Any, device: Any, *, anchor: bool = False) -> Any:
    asm = module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    layers = {i: i for i in range(device.layer_num)}
    return asm.build_pool_entry(
        name=name, host_pool=host, device_pool=device, layer_mapping=layers,
        transfer_layer_id_max=device.layer_num, is_anchor=anchor,
    )


@dataclass
class Rank:
    """One rank's HybridCacheController with our backend attached through SGLang's factory."""

    url: str
    layout: str = "page_first"
    mla: bool = False
    geometry: Geometry = field(default_factory=Geometry)
    parallel: Any = field(default_factory=parallel_state)
    extra: dict[str, Any] = field(default_factory=dict)
    model: str = "org/model"
    sidecars: Sequence[tuple[Any, Any, Any]] = ()  # (PoolName, device pool, host pool)
    enable_storage_metrics: bool = False

    def __post_init__(self) -> None:
        names = module("sglang.srt.mem_cache.hicache_storage")
        self.device, self.host = kv_host_pool(self.geometry, self.layout, mla=self.mla)
        entries = [pool_entry(names.PoolName.KV, self.host, self.device, anchor=True)]
        entries += [pool_entry(n, h, d) for n, d, h in self.sidecars]
        self.group = module("sglang.srt.mem_cache.pool_host").HostPoolGroup(entries)
        controller_cls = module(
            "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
        ).HybridCacheController
        with as_rank(self.parallel):
            self.controller = controller_cls(
                _Allocator(self.device),
                self.group,
                self.geometry.page_size,
                None,  # no TP group: ranks of a test are independent processes' stand-ins
                threading.Event(),
                io_backend="direct",
                storage_backend="dynamic",
                model_name=self.model,
                storage_backend_extra_config=extra_config(self.url, **self.extra),
                transfer_layer_id_max=self.geometry.layers,
                enable_storage_metrics=self.enable_storage_metrics,
            )
        self.storage = self.controller.storage_backend
        self._next_rid = 0

    # -- host pages, by plain indexing (the oracle) -------------------------------------------

    def page(self, page: int) -> torch.Tensor:
        """Page ``page`` of the host pool as [planes, layers, P, heads, D] (a view)."""
        return host_page(self.host, page, mla=self.mla)

    def random_page(self, seed: int) -> torch.Tensor:
        g = self.geometry
        shape = (1, g.layers, g.page_size, 1, g.kv_dim) if self.mla else (
            2, g.layers, g.page_size, g.heads, g.head_dim)
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(-30000, 30000, shape, generator=gen, dtype=torch.int16).view(g.dtype)

    # -- the radix tree's side of the protocol ------------------------------------------------

    def stage(self, pages: Sequence[torch.Tensor]) -> torch.Tensor:
        """Fresh KV host slots holding ``pages`` (their host indices)."""
        g = self.geometry
        host_indices = self.group.alloc(len(pages) * g.page_size)
        assert host_indices is not None
        for i, data in enumerate(pages):
            self.page(int(host_indices[i * g.page_size]) // g.page_size).copy_(data)
        return host_indices

    def backup(self, tokens: Sequence[int], pages: Sequence[torch.Tensor],
               timeout: float = 60.0) -> int:
        """Put ``pages`` into fresh host slots and have SGLang back them up; returns the
        tokens its backup thread reports as stored."""
        host_indices = self.stage(pages)
        hashes = self.hashes(tokens)
        self.controller.write_storage(host_indices, list(tokens), hash_value=hashes)
        op = self.controller.ack_backup_queue.get(timeout=timeout)
        self.group.free(host_indices)
        return int(op.completed_tokens)

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        get_hash_str = module("sglang.srt.mem_cache.utils").get_hash_str
        return list(get_hash_str(list(tokens), None, page_size=self.geometry.page_size))

    def prefetch(self, tokens: Sequence[int], timeout: float = 60.0) -> tuple[int, int, torch.Tensor | None]:
        """Prefetch ``tokens`` as the tree does; returns (hit tokens, loaded tokens, host
        indices of the loaded pages)."""
        base = module("sglang.srt.mem_cache.base_prefix_cache")
        self._next_rid += 1
        handle = base.CacheRequestHandle(rid=f"r{self._next_rid}", attempt_id=0)
        ctrl = self.controller
        op = ctrl.prefetch(handle, list(tokens))
        op = ctrl.prefetch_hit_queue.get(timeout=timeout)
        hit = int(op.storage_hit_count)
        if hit == 0:
            self._drain_acks(op, timeout, expect_transfer=False)
            return 0, 0, None
        host_indices, _ = ctrl.allocate_storage_hit(
            op, hit, allow_partial=False, min_tokens=hit, evict_host=lambda n: 0
        )
        assert host_indices is not None
        op.host_indices = host_indices
        ctrl.prefetch_buffer.put(op)
        loaded = self._drain_acks(op, timeout, expect_transfer=True)
        return hit, loaded, host_indices

    def _drain_acks(self, op: Any, timeout: float, *, expect_transfer: bool) -> int:
        if not expect_transfer:
            return 0
        loaded = 0
        while True:
            ack = self.controller.ack_prefetch_queue.get(timeout=timeout)
            assert ack.operation is op
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.completed_req:
                return loaded

    def host_page_of(self, host_indices: torch.Tensor, i: int) -> torch.Tensor:
        p = self.geometry.page_size
        return self.page(int(host_indices[i * p]) // p)

    def close(self) -> None:
        self.controller.detach_storage_backend()


@dataclass
class Fetched:
    """One prefetch as the tree sees it: the hit, what was loaded, and per sidecar pool the
    transfer (its keys and host slots after the controller re-aligned them) and its count."""

    hit: int
    loaded: int
    host_indices: torch.Tensor | None
    transfers: dict[str, Any]
    pool_hits: dict[str, int]

    def whole(self, page_size: int) -> bool:
        """The tree's all-or-nothing rule (``UnifiedRadixCache``): every pool served all its
        keys and the KV all of the hit, else the whole prefetch is dropped."""
        return self.loaded == self.hit > 0 and all(
            self.pool_hits.get(name, 0) == len(t.keys or ()) for name, t in self.transfers.items()
        )


def random_bytes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)


class HybridRank(Rank):
    """A ``Rank`` whose ``HostPoolGroup`` has sidecar pools, driven as ``UnifiedRadixCache``'s
    SWA and Mamba components drive them (``build_hicache_transfers``): a backup carries each
    node's trailing sidecar pages (SWA: the window's last pages; Mamba: the state at the node
    end, keyed by its last page), a prefetch carries placeholder keys of the trailing length,
    the hit allocates the sidecars' staging and the controller re-aligns their keys.

    ``trailing[name]``: pages the tree keeps of that pool per node (1 for a state)."""

    def __init__(self, url: str, *, trailing: dict[str, int], **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.trailing = trailing
        self.entries = {str(n.value): h for n, _d, h in self.sidecars}

    def sidecar_page(self, name: str, slot: int) -> torch.Tensor:
        """A sidecar host page's bytes, independent of the pool's layout: a KV-shaped pool's
        page as [planes, layers, P, heads, D] (``host_page``), a state as SGLang's own page
        (``get_data_page``)."""
        pool = self.entries[name]
        if hasattr(pool, "kv_buffer") and hasattr(pool, "head_num"):
            page = host_page(pool, slot // pool.page_size)
            return page.contiguous().view(-1).view(torch.uint8).clone()
        return pool.get_data_page(slot, flat=True).view(torch.uint8).clone()

    def fill_sidecar(self, name: str, slot: int, seed: int) -> torch.Tensor:
        """Fill one sidecar page with seeded bytes; returns them (as ``sidecar_page`` reads)."""
        pool = self.entries[name]
        data = random_bytes(self.sidecar_page(name, slot).numel(), seed)
        if hasattr(pool, "kv_buffer") and hasattr(pool, "head_num"):
            page = host_page(pool, slot // pool.page_size)
            page.copy_(data.view(pool.dtype).view(page.shape))
        else:
            pool.set_from_flat_data_page(slot, data.view(pool.get_data_page(slot).dtype))
        return data

    def mark_sidecar(self, name: str, value: int) -> None:
        """Fill every slot of sidecar pool ``name`` with the byte ``value``."""
        pool = self.entries[name]
        for slot in range(0, pool.size, pool.page_size):
            n = pool.get_data_page(slot, flat=True).view(torch.uint8).numel()
            data = torch.full((n,), value, dtype=torch.uint8)
            pool.set_from_flat_data_page(slot, data.view(pool.get_data_page(slot).dtype))

    def backup_hybrid(self, tokens: Sequence[int], pages: Sequence[torch.Tensor],
                      sidecar_seed: int, timeout: float = 60.0) -> tuple[int, dict[str, list[torch.Tensor]], dict[str, int]]:
        """Back up one node: KV ``pages`` and each sidecar's trailing pages filled from
        ``sidecar_seed``. Returns (KV tokens stored, the sidecar pages written, per pool the
        pages SGLang counts as stored)."""
        names = module("sglang.srt.mem_cache.hicache_storage")
        host_indices = self.stage(pages)
        hashes = self.hashes(tokens)
        transfers, written, taken = [], {}, []
        for name, n in self.trailing.items():
            pool = self.entries[name]
            n = min(n, len(hashes))
            slots = pool.alloc(n * pool.page_size)
            assert slots is not None
            taken.append((pool, slots))
            written[name] = [
                self.fill_sidecar(name, int(slots[j * pool.page_size]), sidecar_seed * 100 + j)
                for j in range(n)
            ]
            transfers.append(names.PoolTransfer(
                name=names.PoolName(name), host_indices=slots, keys=hashes[-n:],
                hit_policy=names.PoolHitPolicy.TRAILING_PAGES,
            ))
        self.controller.write_storage(host_indices, list(tokens), hash_value=hashes,
                                      extra_pools=transfers)
        op = self.controller.ack_backup_queue.get(timeout=timeout)
        self.group.free(host_indices)
        for pool, slots in taken:
            pool.free(slots)
        stored = dict(op.pool_storage_result.extra_pool_hit_pages)
        return int(op.completed_tokens), written, {str(k): v for k, v in stored.items()}

    def prefetch_hybrid(self, tokens: Sequence[int], timeout: float = 60.0) -> Fetched:
        names = module("sglang.srt.mem_cache.hicache_storage")
        base = module("sglang.srt.mem_cache.base_prefix_cache")
        self._next_rid += 1
        handle = base.CacheRequestHandle(rid=f"r{self._next_rid}", attempt_id=0)
        transfers = {
            name: names.PoolTransfer(
                name=names.PoolName(name), keys=["__placeholder__"] * n,
                hit_policy=names.PoolHitPolicy.TRAILING_PAGES,
            )
            for name, n in self.trailing.items()
        }
        ctrl = self.controller
        ctrl.prefetch(handle, list(tokens), extra_pools=list(transfers.values()))
        op = ctrl.prefetch_hit_queue.get(timeout=timeout)
        hit = int(op.storage_hit_count)
        if hit == 0:
            return Fetched(0, 0, None, transfers, {})
        host_indices, _ = ctrl.allocate_storage_hit(
            op, hit, allow_partial=False, min_tokens=hit, evict_host=lambda n: 0
        )
        assert host_indices is not None
        hit_pages = hit // self.geometry.page_size
        for name, t in transfers.items():  # _alloc_prefetch_aux_staging
            pool = self.entries[name]
            t.host_indices = pool.alloc(min(len(t.keys), hit_pages) * pool.page_size)
            assert t.host_indices is not None
        op.host_indices = host_indices
        ctrl.prefetch_buffer.put(op)
        loaded, pool_hits = 0, {}
        while True:
            ack = ctrl.ack_prefetch_queue.get(timeout=timeout)
            assert ack.operation is op
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.pool_hits is not None:
                pool_hits.update({str(k): int(v) for k, v in ack.pool_hits.items()})
            if ack.completed_req:
                break
        return Fetched(hit, loaded, host_indices, transfers, pool_hits)


def tokens_for(n_pages: int, page_size: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 150_000 for i in range(n_pages * page_size)]


