"""The weights in the SGLang adapter's and linker's namespaces, through SGLang 0.5.23's own
controller, runtime context and linker factory.

A model of the same name and config with other weights never hits the first one's pages; the
same files at another path do; an explicit ``model_revision`` wins; an online update (what
SGLang records of ``update_weights_from_disk`` and of a ``weight_version`` in its runtime
context, then its own cache flush, which starts the storage threads again) moves the
namespace, and a backup still queued from the old weights is never stored under the new one.
The model directories are real safetensors checkpoints (``_weights``); SGLang's runtime
context is published with SGLang's own ``override_server_args``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from _weights import checkpoint


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@contextmanager
def served(sglang: ModuleType, model_path: Path) -> Iterator[Any]:
    """SGLang's runtime context as a scheduler serving ``model_path`` publishes it."""
    rc = sglang.module_any("sglang.srt.runtime_context")
    with rc.get_context().override_server_args(model_path=str(model_path)):
        yield rc.get_context()


@pytest.fixture
def models(tmp_path: Path) -> SimpleNamespace:
    """``a`` and ``b``: one name (``llama``), one config, other weights; ``a_copy``: ``a``'s
    files at another path."""
    a = checkpoint(tmp_path / "a" / "llama", seed=0)
    b = checkpoint(tmp_path / "b" / "llama", seed=1)
    a_copy = tmp_path / "mirror" / "models" / "llama-copy"
    shutil.copytree(a, a_copy)
    return SimpleNamespace(a=a, b=b, a_copy=a_copy)


def written(sglang: ModuleType, url: str, seed: int, **kw: Any) -> tuple[list[int], list[Any]]:
    """Three pages backed up by a fresh rank's controller; (tokens, pages)."""
    rank = sglang.Rank(url, **kw)
    tokens = sglang.tokens_for(3, rank.geometry.page_size, seed=seed)
    pages = [rank.random_page(seed * 10 + i) for i in range(3)]
    assert rank.backup(tokens, pages) == len(tokens)
    rank.close()
    return tokens, pages


def hits(sglang: ModuleType, url: str, tokens: list[int], pages: list[Any] | None = None,
         **kw: Any) -> int:
    """Tokens a fresh rank's controller finds and loads (the bytes checked when ``pages``)."""
    rank = sglang.Rank(url, **kw)
    try:
        hit, loaded, host_indices = rank.prefetch(tokens)
        assert loaded == hit
        if hit and pages is not None:
            assert host_indices is not None
            for i in range(hit // rank.geometry.page_size):
                assert same(rank.host_page_of(host_indices, i), pages[i])
        return hit
    finally:
        rank.close()


def test_other_weights_under_one_name_never_hit_the_same_files_elsewhere_do(
    sglang: ModuleType, url: str, models: SimpleNamespace
) -> None:
    with served(sglang, models.a):
        tokens, pages = written(sglang, url, seed=1)  # served as "org/model"
    with served(sglang, models.b):
        assert hits(sglang, url, tokens) == 0
    with served(sglang, models.a_copy):
        assert hits(sglang, url, tokens, pages) == len(tokens)


def test_weights_replaced_at_the_same_path_never_hit(
    sglang: ModuleType, url: str, models: SimpleNamespace, tmp_path: Path
) -> None:
    """No runtime context: SGLang's model_name (the --model-path as given) is the directory."""
    path = tmp_path / "served" / "llama"
    shutil.copytree(models.a, path)
    tokens, pages = written(sglang, url, seed=2, model=str(path))
    shutil.copy(models.b / "model.safetensors", path / "model.safetensors")  # new checkpoint
    assert hits(sglang, url, tokens, model=str(path)) == 0
    shutil.copy(models.a / "model.safetensors", path / "model.safetensors")  # and back
    assert hits(sglang, url, tokens, pages, model=str(path)) == len(tokens)


def test_an_explicit_model_revision_wins(
    sglang: ModuleType, url: str, models: SimpleNamespace
) -> None:
    with served(sglang, models.a):
        tokens, pages = written(sglang, url, seed=3, extra={"model_revision": "r1"})
        assert hits(sglang, url, tokens) == 0  # derived from the files: another revision
    with served(sglang, models.b):  # the operator vouches that these weights are r1
        assert hits(sglang, url, tokens, pages, extra={"model_revision": "r1"}) == len(tokens)
        assert hits(sglang, url, tokens, extra={"model_revision": "r2"}) == 0


def test_online_weight_updates_move_the_namespace(
    sglang: ModuleType, url: str, models: SimpleNamespace
) -> None:
    with served(sglang, models.a) as context:
        rank = sglang.Rank(url)
        storage = rank.storage
        p = rank.geometry.page_size
        first = sglang.tokens_for(2, p, seed=4)
        assert rank.backup(first, [rank.random_page(40), rank.random_page(41)]) == len(first)
        assert rank.prefetch(first)[0] == len(first)
        before = storage.namespace

        # update_weights_from_disk: SGLang's ModelRunner.update_model_fields records the path
        context.override("model_runner.update_model_fields", model_path=str(models.b),
                         load_format="auto")
        # a backup still queued from before the flush holds the old weights' KV: not stored
        late = sglang.tokens_for(2, p, seed=5)
        assert rank.backup(late, [rank.random_page(50), rank.random_page(51)]) == 0
        assert storage.counters.get("set_weights_changed", 0) >= 1
        rank.controller.reset()  # SGLang's flush: the storage threads start again
        assert storage.namespace.digest != before.digest
        assert rank.prefetch(first)[0] == 0
        assert rank.prefetch(late)[0] == 0
        assert before.model_revision.startswith("fp-")
        fresh = sglang.tokens_for(2, p, seed=6)
        assert rank.backup(fresh, [rank.random_page(60), rank.random_page(61)]) == len(fresh)
        assert rank.prefetch(fresh)[0] == len(fresh)
        after_disk = storage.namespace

        # an update from tensors with a weight_version: Scheduler.record_weight_version_change
        context.override("scheduler.weight_version", weight_version="rl-step-2")
        rank.controller.reset()
        assert rank.prefetch(fresh)[0] == 0
        assert storage.namespace.model_revision == after_disk.model_revision + "+rl-step-2"

        # an update SGLang does not record: the operator says so
        from hicache_store.layout.namespace import updated_weights

        assert rank.backup(fresh, [rank.random_page(62), rank.random_page(63)]) == len(fresh)
        revision = storage.weights_updated("rl-step-2b")
        assert revision == updated_weights(after_disk.model_revision, "rl-step-2+rl-step-2b")
        rank.controller.reset()
        assert rank.prefetch(fresh)[0] == 0
        rank.close()
    # another server started on the new files with that weight version shares nothing
    # stored before the update
    with served(sglang, models.b):
        assert hits(sglang, url, first) == 0


def test_sglang_records_its_updates_where_the_adapter_reads_them(sglang: ModuleType) -> None:
    """The records the adapter follows are SGLang 0.5.23's own code (read from its source:
    the modules that make them do not import without a GPU stack)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))) / "srt"

    def source(path: str) -> str:
        return " ".join((root / path).read_text().split())

    runner = source("model_executor/model_runner.py")
    assert ('get_context().override( "model_runner.update_model_fields", '
            "model_path=model_path,") in runner
    scheduler = source("managers/scheduler.py")
    assert ('get_context().override("scheduler.weight_version", weight_version=new_version)'
            in scheduler)
    updater = source("managers/scheduler_components/weight_updater.py")
    for call in ("update_weights_from_disk", "update_weights_from_distributed",
                 "update_weights_from_tensor", "update_weights_from_ipc"):
        body = updater.split(f"def {call}(", 1)[1].split("    def ", 1)[0]
        assert "self.record_weight_version_after_update(recv_req.weight_version)" in body
        assert "self.flush_cache_after_weight_update(" in body
    # the flush resets the tree, which resets the controller: storage threads start again
    controller = source("managers/cache_controller.py")
    reset = controller.split("def reset(self):", 2)[2].split("def ", 1)[0]
    assert "self._stop_storage_threads()" in reset and "self.backup_thread.start()" in reset


# -- the linker ------------------------------------------------------------------------------


def linker(sglang: ModuleType, url: str, model_path: Path, **extra: Any) -> Any:
    from test_sglang_linker import make_linker

    return make_linker(sglang, url, server_args=SimpleNamespace(model_path=str(model_path)),
                       **extra)


def offloaded(sglang: ModuleType, link: Any, tokens: list[int], seed: int) -> list[str]:
    from test_sglang_linker import fill, keys_for, kv

    keys = keys_for(sglang, tokens)
    slots = torch.arange(8, 8 + len(tokens))
    fill(link, slots, seed=seed)
    assert link.offload([kv(sglang, keys, slots)])
    deadline = time.monotonic() + 60
    while link.num_completed_offloads() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.pop_completed_offload() is True
    return keys


def lookup(sglang: ModuleType, link: Any, keys: list[str]) -> int:
    from test_sglang_linker import kv

    return len(link.lookup("r", [kv(sglang, keys)]))


def test_the_linker_keeps_other_weights_apart(
    sglang: ModuleType, url: str, models: SimpleNamespace
) -> None:
    from test_sglang_linker import P

    tokens = list(range(300, 300 + 3 * P))
    writer = linker(sglang, url, models.a)
    keys = offloaded(sglang, writer, tokens, seed=7)
    writer.close()
    for path, pages in ((models.b, 0), (models.a_copy, 3)):
        reader = linker(sglang, url, path)
        assert lookup(sglang, reader, keys) == pages
        reader.close()
    assert writer.namespace.model_revision.startswith("fp-")
    explicit = linker(sglang, url, models.b, model_revision=writer.namespace.model_revision)
    assert lookup(sglang, explicit, keys) == 3  # an explicit revision wins
    explicit.close()


def test_the_linker_follows_an_online_update(
    sglang: ModuleType, url: str, models: SimpleNamespace
) -> None:
    from test_sglang_linker import P

    with served(sglang, models.a) as context:
        link = linker(sglang, url, models.a)
        keys = offloaded(sglang, link, list(range(500, 500 + 2 * P)), seed=8)
        assert lookup(sglang, link, keys) == 2
        context.override("model_runner.update_model_fields", model_path=str(models.b),
                         load_format="auto")
        link.reset()  # SGLang's flush after the update resets the tree and its linker
        assert lookup(sglang, link, keys) == 0
        fresh = offloaded(sglang, link, list(range(700, 700 + 2 * P)), seed=9)
        assert lookup(sglang, link, fresh) == 2
        link.weights_updated("v3")
        assert lookup(sglang, link, fresh) == 0
        link.close()
