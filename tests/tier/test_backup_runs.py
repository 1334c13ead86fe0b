"""L3 backups of a chain go out in runs: consecutive pages of one chain in one backend call.

Per-object costs (on the file backend a file, an index update and a settle each) dominate the
backups of small pages, so the backup worker writes a chain's queued pages together
(``L3Link.write_pages``). What must hold either way: every page lands and reads back as the
KV it was, a failed run is reported failed as a whole, and what this instance reports stored
of a chain stays a prefix of it (nothing past a failed page counts as in L3).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from _mini_tier import CONFIG, PAGE, make_tier, prompts
from _serve import serve_checked

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultyBackend
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.hashing import page_hashes
from hicache_store.tier.components import KV_TAG
from hicache_store.tier.transfers import RUN_PAGES

PAGES = 40


class RecordingBackend(FaultyBackend):
    """A file backend (faults off) that records each ``put``'s size and refuses any ``put``
    that holds a key containing ``refuse``."""

    def __init__(self, root: Path) -> None:
        super().__init__(open_backend(f"file://{root}"))
        self.put_sizes: list[int] = []
        self.refuse: str | None = None

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        self.put_sizes.append(len(keys))
        if self.refuse is not None and any(self.refuse in key for key in keys):
            raise OSError("injected: the store refused this batch")
        await super()._put(keys, buffers)


def test_a_chain_is_written_in_runs_and_reads_back_exactly(tmp_path: Path) -> None:
    model = MiniLlama(CONFIG)
    (doc,) = prompts(11, 1, PAGES * PAGE)
    backend = RecordingBackend(tmp_path / "l3")
    tier = make_tier(PAGES + 4, PAGES + 4, backend)
    assert serve_checked(tier, model, doc).start == 0
    tier.flush(timeout=30)
    assert tier.metrics.backups_l3 == PAGES and tier.metrics.backups_l3_failed == 0
    # Fewer backend calls than pages (runs), none longer than a run.
    assert sum(backend.put_sizes) == PAGES
    assert len(backend.put_sizes) < PAGES and max(backend.put_sizes) <= RUN_PAGES
    assert tier.metrics.bytes_l2_to_l3 > 0
    tier.close()
    # Another instance reads the whole chain from L3, and its KV is the recompute's.
    other = make_tier(PAGES + 4, PAGES + 4, backend, prefetch_policy="wait_complete")
    served = serve_checked(other, model, [*doc, 1])
    assert served.start == PAGES * PAGE and other.metrics.hit_tokens_l3 == PAGES * PAGE
    other.close()


def test_a_failed_run_leaves_what_counts_as_stored_a_prefix(tmp_path: Path) -> None:
    model = MiniLlama(CONFIG)
    (doc,) = prompts(12, 1, PAGES * PAGE)
    backend = RecordingBackend(tmp_path / "l3")
    tier = make_tier(PAGES + 4, PAGES + 4, backend)
    hashes = page_hashes(doc, PAGE, algo=tier.namespace.hash_algo)
    bad = 5  # the run holding this page is refused; nothing after it may count as stored
    backend.refuse = hashes[bad]
    assert serve_checked(tier, model, doc).start == 0
    tier.flush(timeout=30)
    stored = []
    for h in hashes:
        node = tier.tree.get(h)
        assert node is not None
        copy = node.copy(KV_TAG)
        stored.append(copy is not None and copy.in_l3)
    assert not stored[bad]
    first_missing = stored.index(False)
    assert not any(stored[first_missing:]), f"stored past a failed page: {stored}"
    assert tier.metrics.backups_l3 == first_missing
    assert tier.metrics.backups_l3_failed == PAGES - first_missing
    tier.close()
    # The store heals on a later backup once it takes the batch again.
    backend.refuse = None
    again = make_tier(PAGES + 4, PAGES + 4, backend, prefetch_policy="wait_complete")
    served = serve_checked(again, model, [*doc, 2])
    assert served.start == first_missing * PAGE
    again.flush(timeout=30)
    assert again.metrics.backups_l3 == PAGES - first_missing
    again.close()
    last = make_tier(PAGES + 4, PAGES + 4, backend, prefetch_policy="wait_complete")
    assert serve_checked(last, model, [*doc, 3]).start == PAGES * PAGE
    last.close()
