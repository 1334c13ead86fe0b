"""SGLang 0.5.23's own controller backing up pages of many objects each on a loaded disk.

Grid 1x1 on a model of 4 layers x 8 KV heads (head dim 64, 16 tokens a page): every page is
32 objects of 4 KiB, written through ``L3Link.write_in_order``. The controller backs up 150
pages (``batch_set_v1`` with 128, then 22) while competing writer processes fsync on the same
filesystem (``_disk_load``: contention, not an injected latency). Before, every page's puts
reached the file backend at once, the chunk's deadline expired on all of them, and none was
stored. Now the pages go oldest first, in runs, so a loaded disk stores and reports a leading
run of them (all, on a disk fast enough), and SGLang's hit query finds exactly those and its
prefetch brings them back, byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _disk_load import competing_writers

PAGES = 150
PAGE_SIZE = 16
#: the floor of each chunk's deadline; the chunk of 128 pages (32 MiB of frames) gets 2 s
#: more at the default 16 MiB/s
IO_TIMEOUT_S = 5.0


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def leading(results: list[bool]) -> int:
    return results.index(False) if False in results else len(results)


@pytest.mark.slow
def test_a_backup_of_many_objects_a_page_on_a_loaded_disk_keeps_a_leading_run(
    sglang: ModuleType, tmp_path: Path
) -> None:
    geometry = sglang.Geometry(
        layers=4, heads=8, head_dim=64, page_size=PAGE_SIZE, device_tokens=PAGES * PAGE_SIZE
    )
    rank = sglang.Rank(f"file://{tmp_path / 'kv'}", geometry=geometry,
                       extra={"grid": "1x1", "io_timeout_s": IO_TIMEOUT_S})
    storage = rank.storage
    reg = storage._registered
    objects = reg.link.write_plan.objects
    assert not reg.fused_write and len(objects) == 32
    assert all(obj.nbytes == 4096 for obj in objects)
    calls: list[list[bool]] = []  # what the adapter reported to SGLang, call by call
    batch_set_v1 = storage.batch_set_v1

    def recorded(keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        results: list[bool] = batch_set_v1(keys, host_indices, extra_info)
        calls.append(results)
        return results

    storage.batch_set_v1 = recorded
    tokens = sglang.tokens_for(PAGES, PAGE_SIZE, seed=48)
    hashes = rank.hashes(tokens)
    pages = [rank.random_page(s) for s in range(PAGES)]
    with competing_writers(tmp_path / "load"):
        completed = rank.backup(tokens, pages, timeout=300)
        # SGLang's hit query on the loaded disk finds what was stored
        landed = storage.batch_exists(hashes)
    assert [len(c) for c in calls] in ([128, 22], [128]), [len(c) for c in calls]
    # Each call reports a leading run of its pages stored, never none on the first.
    for results in calls:
        assert results == [True] * leading(results) + [False] * (len(results) - leading(results))
    stored = sum(leading(c) for c in calls)
    assert leading(calls[0]) > 0, "a chunk on a loaded disk stored none of its pages"
    assert storage.counters["set_pages"] == stored
    # SGLang counts a chunk only when all of it is stored, then stops at the first that is not.
    whole = 0
    for results in calls:
        if not all(results):
            break
        whole += len(results)
    assert completed == whole * PAGE_SIZE
    # What was reported stored is stored: the hit query finds it (a page cut by the deadline
    # may have landed too, whole: reported False, never True for one that is not).
    assert stored <= landed <= PAGES
    assert landed == PAGES or not all(c == [True] * len(c) for c in calls)
    # and SGLang's own prefetch brings it back, byte for byte (a leading run of it: the reads
    # have a deadline of their own on a machine this loaded)
    hit, loaded, got = rank.prefetch(tokens, timeout=300)
    assert hit == landed * PAGE_SIZE and got is not None
    assert 0 < loaded <= hit and loaded % PAGE_SIZE == 0
    for i in range(loaded // PAGE_SIZE):
        assert same(rank.host_page_of(got, i), pages[i]), i
    rank.close()
