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


def kv_host_pool(geometry: Geometry, layout: str, *, mla: bool = False) -> tuple[Any, Any]:
    """(device pool, host pool) of SGLang's real classes for one rank."""
    g = geometry
    memory_pool = module("sglang.srt.mem_cache.memory_pool")
    end = g.start_layer + g.layers
    common: dict[str, Any] = {"start_layer": g.start_layer, "end_layer": end}
    if mla:
        device = memory_pool.MLATokenToKVPool(
            size=g.device_tokens, page_size=g.page_size, dtype=g.dtype,
            kv_lora_rank=g.kv_dim - 4, qk_rope_head_dim=4, layer_num=g.layers,
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
        p = self.geometry.page_size
        # MLA pools have no K/V axis and a head axis of 1: one plane of one head
        kv = self.host.kv_buffer if not self.mla else self.host.kv_buffer.unsqueeze(0)
        s = slice(page * p, (page + 1) * p)
        if self.layout == "layer_first":
            return kv[:, :, s]
        if self.layout == "page_first":
            return kv[:, s].permute(0, 2, 1, 3, 4)
        if self.layout == "page_first_direct":
            return kv[:, page]
        return kv[:, page].permute(0, 3, 2, 1, 4)  # page_head: [2, H, P, L, D]

    def random_page(self, seed: int) -> torch.Tensor:
        g = self.geometry
        shape = (1, g.layers, g.page_size, 1, g.kv_dim) if self.mla else (
            2, g.layers, g.page_size, g.heads, g.head_dim)
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(-30000, 30000, shape, generator=gen, dtype=torch.int16).view(g.dtype)

    # -- the radix tree's side of the protocol ------------------------------------------------

    def backup(self, tokens: Sequence[int], pages: Sequence[torch.Tensor],
               timeout: float = 60.0) -> int:
        """Put ``pages`` into fresh host slots and have SGLang back them up; returns the
        tokens its backup thread reports as stored."""
        g = self.geometry
        host_indices = self.group.alloc(len(pages) * g.page_size)
        assert host_indices is not None
        for i, data in enumerate(pages):
            self.page(int(host_indices[i * g.page_size]) // g.page_size).copy_(data)
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


def tokens_for(n_pages: int, page_size: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 150_000 for i in range(n_pages * page_size)]


