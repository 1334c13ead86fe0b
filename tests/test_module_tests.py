"""Every library module's tests are found by its path: ``tests/<package>/test_<module>.py``.

``<package>`` is the name of the folder the module is in (``tier`` for
``hicache_store/tier/cache.py``, ``vllm`` for ``hicache_store/integrations/vllm/connector.py``,
``layout`` for ``layout/keys.py``); a module directly in ``hicache_store/`` is a package of its
own (``tests/reader/test_reader.py``, ``tests/sync/`` for ``sync.py`` and ``_sync.py``).
``<module>`` is the file's name without its leading underscores. Also found: a folder
``tests/<package>_<what>/`` (backends tested against a server: ``tests/backends_s3/``), the
package's name before the module's (``tests/kernels/test_kernels_reference.py``), and an aspect
after it (``tests/backends/test_file_crash.py``).

A module without such a file is listed in ``NO_TEST_FILE`` with the reason, most often the
public module whose tests cover it. A new module without a test file of its name fails here, and
so does a listed module that is gone or has one now: the list stays true.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: the source folders of the package (setup.py's ``PACKAGE_DIR``).
SOURCES = ("layout", "kernels", "backends", "hicache_store")

_COMMAND = "a command over its library module, driven end to end with it in "
_SERVED = "the mini engine's harness, driven by "

#: modules with no test file of their name, and why.
NO_TEST_FILE: dict[str, str] = {
    "layout/dtypes.py": "a table of dtype names and sizes, checked through tests/layout/test_namespace.py",
    "layout/errors.py": "the exception classes; each is asserted by the tests of the code that raises it",
    "layout/manifest.py": "the manifest bytes, round-tripped through ops.manifest in tests/ops/test_inspection_verify.py",
    "kernels/_pages.py": "private part of kernels.ops (page lists to slot tables): tests/kernels/test_kernels_reference.py",
    "kernels/_plan.py": "private part of kernels.ops (launcher validation): tests/kernels/test_kernels_ops_validation.py",
    "kernels/_triton_kernel.py": "the kernel behind kernels.triton_ops: tests/kernels/test_kernels_triton_ops*.py",
    "kernels/_unified.py": "private part of kernels.ops (the unified side of a copy): tests/kernels/",
    "kernels/_views.py": "private part of kernels.reference (view rewrites): tests/kernels/test_kernels_reference.py",
    "kernels/pools.py": "the pool descriptions every kernel test builds (tests/kernels/kernel_cases.py)",
    "backends/aio.py": "the deadline helpers of the backends and the object I/O: their timeout tests (tests/backends/test_faulty.py)",
    "backends/_aligned.py": "aligned_buffer, public from backends: tests/backends/test_file.py (O_DIRECT reads)",
    "backends/_file_io.py": "private part of backends.file (its I/O engines): tests/backends/test_file_released_reads.py, tests/backends/test_protocols.py (hf3fs's POSIX path on the native engine)",
    "backends/_file_root.py": "private part of backends.file (opening a root, its layout marker, dead writers' temp files): tests/backends/test_file.py, test_file_crash.py",
    "backends/_file_index_db.py": "private part of the SQLite index (connections, schema): tests/backends/test_file_index.py, test_index_contract_sqlite.py",
    "backends/_file_index_membership.py": "private part of the SQLite index (the fingerprint snapshot): tests/backends/test_file_index.py",
    "backends/_file_index_recovery.py": "private part of the SQLite index (killed writers): tests/backends/test_file_index.py, test_index_contract_sqlite.py",
    "backends/_file_index_rows.py": "private part of the SQLite index (rows and ranks): tests/backends/test_index_contract_sqlite.py",
    "backends/_file_index_writes.py": "private part of the SQLite index (reserve, make room, settle): tests/backends/test_index_contract_sqlite.py",
    "backends/_file_objects.py": "the file backend's objects as an index sees them: tests/backends/test_index_contract_sqlite.py, tests/backends_valkey/test_file_valkey.py",
    "backends/_index_check.py": "an index against its store (doctor, gc's reconcile): tests/backends_valkey/test_valkey_link_failure.py, tests/backends_valkey/test_fleet.py",
    "backends/_s3_objects.py": "an S3 prefix as an index sees it: tests/backends_valkey/test_s3_valkey.py",
    "backends/_valkey_keys.py": "private part of the Valkey index (packed keys): tests/backends_valkey/test_valkey_index_contract.py",
    "backends/_valkey_pages.py": "private part of the Valkey index (listings, the feed, the build): tests/backends_valkey/test_valkey_index_contract.py",
    "backends/_valkey_scripts.py": "the Valkey index's server-side steps: tests/backends_valkey/test_valkey_index_contract.py",
    "hicache_store/testing/index.py": "the index contract suite itself, run by tests/backends/test_index_contract_sqlite.py and tests/backends_valkey/test_valkey_index_contract.py",
    "backends/_fingerprints.py": "private part of the file index: tests/backends/test_file_index.py",
    "backends/_lru.py": "private order of the bounded backends: tests/backends/test_memory.py, test_file.py",
    "backends/_mooncake_client.py": "private part of backends.mooncake: tests/backends_mooncake/",
    "backends/mooncake_local.py": "a throwaway Mooncake deployment the Mooncake tests run on (tests/backends_mooncake/)",
    "backends/_pagecache.py": "the file backend's read policy: tests/backends/test_file_released_reads.py",
    "backends/_s3_errors.py": "private edge of backends.s3: tests/backends_s3/test_s3_behaviour.py",
    "backends/_s3_io.py": "private helpers of backends.s3: tests/backends_s3/test_s3_behaviour.py",
    "backends/_s3_client.py": "private part of backends.s3 (client, pool, deadlines, the requests): tests/backends_s3/test_s3_behaviour.py, test_s3_conformance.py",
    "backends/_s3_capacity.py": "private part of backends.s3 (capacity_bytes without an index): tests/backends_s3/test_s3_behaviour.py, test_s3_conformance.py (capacity on)",
    "backends/_file_jobs.py": "private part of backends.file (its pool and error edge): tests/backends/test_file.py, test_file_contention.py",
    "backends/_file_writes.py": "private part of backends.file (the put protocol): tests/backends/test_file.py, test_file_contention.py, test_file_crash.py",
    "backends/abilities.py": "the optional abilities' accessors and default hooks on Backend: tests/backends/test_protocols.py",
    "backends/base.py": "the Backend contract: the conformance suite (hicache_store.testing) every backend's tests run",
    "backends/errors.py": "the storage exceptions; asserted by each backend's tests where they are raised",
    "backends/file_layout.py": "the file layout's object paths: tests/backends/test_file.py (shard_of), and every file-backend test that reads a root's files",
    "backends/helpers.py": "the helpers on Backend's core: the conformance suite (hicache_store.testing) and tests/backends/test_prefix_search.py",
    "backends/lifetime.py": "the buffer lifetime machinery: testing.BufferLifetimeTests, which every backend's conformance tests run",
    "backends/retention.py": "the retention contract: testing.RetentionTests in tests/backends/test_*_retention.py",
    "backends/types.py": "value types every backend test uses (ByteRange, Capabilities, BackendURL)",
    "backends/views.py": "caller buffers as byte views: the conformance suite (numpy arrays, bytearrays and memoryviews into every backend)",
    "hicache_store/commands/_common.py": "what the commands share; every command test runs through it (tests/cli/)",
    "hicache_store/commands/bench_pd.py": "needs the P/D fixtures of tests/pd/: tests/pd/test_bench_pd.py",
    "hicache_store/commands/bench_trace.py": _COMMAND + "tests/bench/test_trace_replay.py",
    "hicache_store/commands/doctor.py": _COMMAND + "tests/ops/test_doctor.py",
    "hicache_store/commands/events.py": _COMMAND + "tests/events/test_store_events.py",
    "hicache_store/commands/gc.py": _COMMAND + "tests/ops/test_gc.py",
    "hicache_store/commands/inspect.py": _COMMAND + "tests/ops/test_inspection_verify.py",
    "hicache_store/commands/prepopulate.py": _COMMAND + "tests/ops/test_prepopulate_*.py",
    "hicache_store/commands/serve_query.py": _COMMAND + "tests/query/test_serve_query_cli.py",
    "hicache_store/commands/tenant_key.py": _COMMAND + "tests/tenant/test_tenant_cli.py",
    "hicache_store/demo/bench/hybrid.py": _SERVED + "tests/commands/test_bench_multiturn_hybrid.py",
    "hicache_store/demo/bench/multiturn.py": _SERVED + "tests/tier/test_faulty_workload.py and the bench tests",
    "hicache_store/demo/bench/pd.py": _SERVED + "tests/pd/test_bench_pd.py",
    "hicache_store/demo/bench/pd_worker.py": _SERVED + "tests/pd/ (the prefill worker process)",
    "hicache_store/demo/bench/workload.py": _SERVED + "tests/tier/test_abandoned_reads.py, tests/pd/",
    "hicache_store/demo/draft.py": _SERVED + "tests/tier/test_components_draft.py",
    "hicache_store/demo/engine/source.py": _SERVED + "tests/reader/, tests/query/ (stores filled by it)",
    "hicache_store/demo/hybrid.py": _SERVED + "tests/tier/test_components_hybrid.py",
    "hicache_store/demo/launch.py": _SERVED + "tests/distributed/ (real rank processes)",
    "hicache_store/demo/sharded.py": _SERVED + "tests/distributed/ (one rank of a TP x PP deployment)",
    "hicache_store/distributed/cp.py": "needs real ranks: tests/distributed/test_ranks.py (context parallelism)",
    "hicache_store/distributed/group.py": "needs real ranks: tests/distributed/test_ranks.py",
    "hicache_store/errors.py": "re-exports the layers' exceptions: tests/cli/test_cli_usage_errors.py",
    "hicache_store/integrations/sglang/_metrics.py": "private part of the SGLang adapter: tests/sglang/test_sglang_storage*.py",
    "hicache_store/integrations/sglang/_namespace.py": "private part of the SGLang adapter: tests/sglang/test_sglang_storage.py",
    "hicache_store/integrations/sglang/_pool.py": "private part of the SGLang adapter: tests/sglang/test_sglang_storage.py",
    "hicache_store/integrations/sglang_linker.py": "the linker's load path, which tests/sglang/test_sglang_linker.py loads it by",
    "hicache_store/integrations/vllm/_config.py": "private part of the vLLM connector: tests/vllm/test_vllm_startup.py",
    "hicache_store/integrations/vllm/_logging.py": "private part of the vLLM connector: tests/vllm/test_vllm_startup.py (its log lines)",
    "hicache_store/integrations/vllm/_caches.py": "private part of the vLLM connector (its groups' caches): tests/vllm/test_vllm_families.py and tests/vllm/test_vllm_cpu_cache_layout.py",
    "hicache_store/integrations/vllm/_l2.py": "runs without vLLM, unlike tests/vllm/: tests/integrations/test_vllm_l2.py",
    "hicache_store/objects/failures.py": "the failed-write log: tests/backends/test_file_full_disk.py",
    "hicache_store/objects/manifest.py": "manifests on a backend, through ops.manifest: tests/ops/test_inspection_verify.py",
    "hicache_store/objects/sealed.py": "the sealed format: tests/tenant/ and tests/objects/test_offload.py",
    "hicache_store/ops/deployment.py": "the namespace doctor and prepopulate derive: tests/ops/test_doctor.py, test_prepopulate_*",
    "hicache_store/ops/manifest.py": "tests/ops/test_inspection_verify.py, tests/ops/test_ukv1_keyspace.py",
    "hicache_store/ops/progress.py": "the commands' progress on stderr: tests/ops/test_cli_ops.py",
    "hicache_store/ops/sources.py": "what prepopulate computes from: tests/ops/test_prepopulate_hf.py",
    "hicache_store/ops/store.py": "open_store of every command: tests/ops/test_cli_ops.py",
    "hicache_store/pd/decode.py": "one side of P/D, tested with the other: tests/pd/test_pd_serving.py",
    "hicache_store/pd/mooncake.py": "a transport of tests/pd/test_transport.py",
    "hicache_store/pd/pages.py": "P/D's page rows: tests/pd/test_transport.py, test_pd_serving.py",
    "hicache_store/pd/prefill.py": "one side of P/D, tested with the other: tests/pd/test_pd_serving.py",
    "hicache_store/pd/state.py": "the state P/D hands over for hybrid models: tests/pd/test_pd_hybrid.py",
    "hicache_store/sglang_config.py": "the SGLang adapter's keys: tests/sglang/test_sglang_storage.py (extra-config cases)",
    "hicache_store/testing/backend.py": "the conformance suite, tested by mutants: tests/testing/test_mutants.py",
    "hicache_store/testing/capacity.py": "part of the conformance suite (CapacityUsageTests): run by tests/backends/test_memory_retention.py, test_file_retention.py, tests/backends_s3/test_s3_behaviour.py and tests/backends_valkey/; a miscounting backend fails it in tests/backends/test_memory_retention.py",
    "hicache_store/testing/chains.py": "stores of page chains for gc and inspect: tests/ops/test_gc.py",
    "hicache_store/testing/lifetime.py": "part of the conformance suite: tests/testing/test_mutants.py",
    "hicache_store/testing/retention.py": "part of the conformance suite: tests/backends/test_*_retention.py",
    "hicache_store/testing/stateful.py": "part of the conformance suite: tests/testing/test_mutants.py",
    "hicache_store/tier/checks.py": "HiCache.check_invariants, run by the tier tests (tests/tier/test_cache_tier.py)",
    "hicache_store/tier/config.py": "TierConfig, built by every tier test (tests/tier/test_cache_tier.py)",
    "hicache_store/tier/group.py": "rank agreement: tests/distributed/test_ranks.py",
    "hicache_store/tier/hinting.py": "the tier's side of hints: tests/tier/test_tier_hints.py",
    "hicache_store/tier/links.py": "the L3 links and host-buffer registration HiCache is built with: tests/tier/test_backup_runs.py, test_l3_knowledge.py",
    "hicache_store/tier/loads.py": "L2 -> L1 loads through HiCache: tests/tier/test_shared_loads.py, test_cache_tier.py",
    "hicache_store/tier/host_pool.py": "the L2 rows HiCache keeps: tests/tier/test_cache_tier.py",
    "hicache_store/tier/metrics.py": "the tier's counters: tests/integrations/test_lookups.py, tests/tier/",
    "hicache_store/tier/pins.py": "the pages hints hold: tests/tier/test_tier_hints.py",
    "hicache_store/tier/pools.py": "L1 <-> L2 copies: tests/tier/test_shared_loads.py, test_tier_extend_abort.py",
    "hicache_store/tier/prefetch.py": "the prefetch protocol through HiCache: tests/tier/test_abandoned_reads.py",
    "hicache_store/tier/prefix.py": "the resume prefix through HiCache: tests/tier/test_components_*.py",
    "hicache_store/tier/request.py": "match / prepare records, through HiCache: tests/tier/test_cache_tier.py",
    "hicache_store/tier/residency.py": "the residency primitives through HiCache: tests/tier/test_cache_tier.py, test_tier_events.py (L2 admission), tests/bench/test_trace_format_weka.py",
    "hicache_store/tier/restore.py": "component restores through HiCache: tests/tier/test_components_*.py",
}


def modules(root: Path) -> dict[str, tuple[str, str]]:
    """Every library module below ``root``: its path -> (package, module name) of its test file."""
    found: dict[str, tuple[str, str]] = {}
    for source in SOURCES:
        for path in sorted((root / source).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            parts = path.relative_to(root).parts
            name = path.stem.lstrip("_")
            package = name if parts[0] == "hicache_store" and len(parts) == 2 else parts[-2]
            found["/".join(parts)] = (package, name)
    return found


def files_of(tests: Path, package: str, name: str) -> list[Path]:
    """The test files of module ``name`` of ``package`` (see the module docstring)."""
    pattern = re.compile(rf"test_(?:{re.escape(package)}_)?{re.escape(name)}(?:_\w+)?\.py")
    return sorted(
        path for path in tests.glob("*/test_*.py")
        if (path.parent.name == package or path.parent.name.startswith(package + "_"))
        and pattern.fullmatch(path.name)
    )


def without_test_files(root: Path, tests: Path) -> list[str]:
    return [path for path, (package, name) in modules(root).items()
            if not files_of(tests, package, name)]


def test_every_module_has_a_test_file_of_its_name_or_a_reason() -> None:
    found = modules(ROOT)
    # the walk sees the library, or an empty result would prove nothing
    assert {"layout/keys.py", "backends/file.py", "hicache_store/tier/cache.py",
            "hicache_store/integrations/vllm/connector.py"} <= found.keys()
    missing = set(without_test_files(ROOT, TESTS))
    assert sorted(missing - NO_TEST_FILE.keys()) == [], (
        "modules with no tests/<package>/test_<module>.py: add one (or, for a private part "
        "tested through its public module, a line in NO_TEST_FILE saying where)")
    assert sorted(NO_TEST_FILE.keys() - missing) == [], (
        "listed in NO_TEST_FILE but gone or with a test file of its name now: drop the line")


@pytest.mark.parametrize(
    ("module", "tests", "found"),
    [
        ("hicache_store/tier/cache.py", ["tier/test_cache.py"], True),
        ("hicache_store/tier/cache.py", ["tier/test_cache_tier.py"], True),
        ("hicache_store/tier/cache.py", ["tier/test_tier_cache.py"], True),
        ("hicache_store/tier/cache.py", ["tier/test_cachebox.py"], False),
        ("hicache_store/tier/cache.py", ["objects/test_cache.py"], False),
        ("backends/_file_index.py", ["backends/test_file_index.py"], True),
        ("backends/s3.py", ["backends_s3/test_s3_conformance.py"], True),
        ("hicache_store/integrations/sglang/storage.py", ["sglang/test_sglang_storage_ukv1.py"], True),
        ("hicache_store/integrations/sglang/storage.py", ["integrations/test_sglang.py"], False),
        ("hicache_store/_sync.py", ["sync/test_sync_bridge.py"], True),
        ("hicache_store/reader.py", ["reader/test_reader.py"], True),
        ("hicache_store/reader.py", ["test_reader.py"], False),
        ("layout/keys.py", ["layout/sub/test_keys.py"], False),
    ],
)
def test_the_rule(tmp_path: Path, module: str, tests: list[str], found: bool) -> None:
    """A planted module is found, or reported, by where its test files are."""
    for source in SOURCES:
        (tmp_path / source).mkdir()
    (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / module).write_text("")
    for name in tests:
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text("")
    assert without_test_files(tmp_path, tmp_path / "tests") == ([] if found else [module])
