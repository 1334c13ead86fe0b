"""The registry: built-ins, lazy imports with install hints, entry points, module:Class specs."""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_store.backends import (
    ENTRY_POINT_GROUP,
    Backend,
    BackendURL,
    ConfigError,
    DuplicateBackendError,
    MissingDependencyError,
    UnknownBackendError,
    available_backends,
    backends,
    get_backend_class,
    open_backend,
    register_backend,
    unregister_backend,
)
from hicache_store.backends.file import FileBackend
from hicache_store.backends.memory import MemoryBackend

PLUGIN_HINT = "pip install --no-deps --no-build-isolation -e tests/plugins/example_backend"


@pytest.fixture
def scratch_name() -> Iterator[str]:
    yield "scratch-test"
    unregister_backend("scratch-test")


def test_builtins_are_registered_lazily() -> None:
    for name in ("file", "memory", "faulty", "s3", "fsspec", "hf3fs", "mooncake"):
        assert backends[name].origin == "builtin"
        assert isinstance(backends[name].target, str)  # an import string, nothing imported


def test_the_public_view_is_read_only() -> None:
    with pytest.raises(TypeError):
        backends["mine"] = backends["file"]  # type: ignore[index]


def test_open_by_url_with_query_options(tmp_path: Path) -> None:
    store = open_backend(f"file://{tmp_path}/kv?durability=full&io_threads=3", capacity_bytes="1MiB")
    assert isinstance(store, FileBackend)
    assert (store.durability, store.io_threads, store.capacity_bytes) == ("full", 3, 1 << 20)
    assert store.root == (tmp_path / "kv").resolve()


def test_open_by_config_mapping_as_engine_extra_config(tmp_path: Path) -> None:
    store = open_backend({"url": f"file://{tmp_path}/kv", "durability": "none"})
    assert isinstance(store, FileBackend) and store.durability == "none"
    store = open_backend({"backend": "memory", "capacity_bytes": "2MiB"})
    assert isinstance(store, MemoryBackend) and store.capacity_bytes == 2 << 20


def test_keyword_options_override_the_query() -> None:
    store = open_backend("memory://?capacity_bytes=100", capacity_bytes=200)
    assert isinstance(store, MemoryBackend) and store.capacity_bytes == 200


def test_open_by_module_class_spec() -> None:
    store = open_backend("hicache_store.backends.memory:MemoryBackend", capacity_bytes=10)
    assert isinstance(store, MemoryBackend)
    assert get_backend_class("hicache_store.backends.memory:MemoryBackend") is MemoryBackend


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match="file") as info:
        open_backend("nosuch://x")
    assert isinstance(info.value, LookupError)


def test_unwritten_builtin_gives_a_clear_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    register_backend("ghost", "hicache_store.backends.ghost:GhostBackend",
                     install_hint="pip install ghost", replace=True)
    try:
        with pytest.raises(MissingDependencyError, match="pip install ghost") as info:
            open_backend("ghost://x")
        assert isinstance(info.value, ImportError)
        assert "does not exist" in str(info.value)
    finally:
        unregister_backend("ghost")


def test_missing_dependency_names_it_with_the_hint(tmp_path: Path) -> None:
    module = tmp_path / "needs_dep_backend.py"
    module.write_text("import surely_not_installed_xyz\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        register_backend("needsdep", "needs_dep_backend:X", install_hint="pip install xyz")
        with pytest.raises(MissingDependencyError, match="surely_not_installed_xyz.*pip install xyz"):
            get_backend_class("needsdep")
    finally:
        sys.path.remove(str(tmp_path))
        unregister_backend("needsdep")


def test_duplicates_are_refused(scratch_name: str) -> None:
    register_backend(scratch_name, MemoryBackend)
    with pytest.raises(DuplicateBackendError):
        register_backend(scratch_name, "hicache_store.backends.file:FileBackend")
    with pytest.raises(DuplicateBackendError):
        register_backend("file", MemoryBackend)
    register_backend(scratch_name, FileBackend, replace=True)
    assert get_backend_class(scratch_name) is FileBackend


@pytest.mark.parametrize("bad", ["", "Upper", "1abc", "a/b", "a b"])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="backend name"):
        register_backend(bad, MemoryBackend)


def test_bad_targets_are_refused(scratch_name: str) -> None:
    with pytest.raises(ValueError, match="module:Class"):
        register_backend(scratch_name, "not a spec")
    with pytest.raises(TypeError):
        register_backend(scratch_name, dict)  # type: ignore[arg-type]


def test_a_class_that_is_not_a_backend_is_refused() -> None:
    with pytest.raises(Exception, match="not a hicache_store Backend"):
        get_backend_class("collections:OrderedDict")


def test_location_refused_by_location_free_backends() -> None:
    with pytest.raises(ValueError, match="no location"):
        open_backend("memory://somewhere")


def test_url_parsing() -> None:
    url = BackendURL.parse("s3://bucket/pre/fix?region=x&a=1")
    assert (url.scheme, url.location, url.query) == ("s3", "bucket/pre/fix", {"region": "x", "a": "1"})
    assert BackendURL.parse("file:///var/kv").location == "/var/kv"
    with pytest.raises(ValueError, match="scheme"):
        BackendURL.parse("/var/kv")


@pytest.mark.parametrize("scheme", ["file", "hf3fs"])
def test_a_local_url_with_a_host_part_is_refused(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``file://tmp/x`` once wrote to ./tmp/x: the host part must be an error, creating nothing.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"'tmp' is a host part.*{scheme}:///tmp/x"):
        open_backend(f"{scheme}://tmp/x")
    with pytest.raises(ValueError, match="absolute directory"):
        open_backend(f"{scheme}://")
    assert list(tmp_path.iterdir()) == []


def test_file_url_forms_that_name_a_path(tmp_path: Path) -> None:
    for url in (f"file://{tmp_path}/a", f"file://localhost{tmp_path}/b"):
        store = open_backend(url)
        assert isinstance(store, FileBackend)
        asyncio.run(store.close())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


# -- the example plugin, installed as a real distribution with an entry point ----------------


def _plugin_installed() -> bool:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return any(ep.name == "example" for ep in eps)


needs_plugin = pytest.mark.skipif(not _plugin_installed(), reason=f"example plugin not installed: {PLUGIN_HINT}")


@needs_plugin
def test_entry_point_plugin_is_found_and_opened() -> None:
    assert "example" in available_backends()
    assert backends["example"].origin == "entry-point"
    store = open_backend("example://registry-test?capacity_items=3")
    assert isinstance(store, Backend)
    assert type(store).__module__ == "hicache_example_backend"
    assert store.capacity_items == 3  # type: ignore[attr-defined]


@needs_plugin
async def test_entry_point_plugin_works_end_to_end() -> None:
    store = open_backend("example://e2e")
    await store.put(["a0"], [b"plugin"])
    assert await open_backend("example://e2e").get_bytes("a0") == b"plugin"


def test_a_sub_protocol_scheme_opens_its_backend() -> None:
    from hicache_store.backends import open_backend
    from hicache_store.backends.fsspec import FsspecBackend

    store = open_backend("fsspec+memory://registry-test")
    assert isinstance(store, FsspecBackend)
    assert store.protocol == "memory"


def test_a_misspelled_scheme_is_a_config_error_with_its_close_spelling() -> None:
    with pytest.raises(ConfigError, match=r"no backend named 'fiel' \(did you mean 'file'\?\)"):
        open_backend("fiel:///srv/kv")
    with pytest.raises(ConfigError, match=r"did you mean 'memory'"):
        open_backend({"url": "memroy://"})


@pytest.mark.parametrize(("text", "meant"), [
    ("/srv/kv", "file:///srv/kv"),
    ("file:/srv/kv", "file:///srv/kv"),
    ("file:srv/kv", f"file://{Path.cwd()}/srv/kv"),
    ("./kv", f"file://{Path.cwd()}/kv"),
    ("s3:bucket/prefix", "s3://bucket/prefix"),
])
def test_what_is_no_url_is_a_config_error_saying_what_was_meant(text: str, meant: str) -> None:
    with pytest.raises(ConfigError, match="is not a backend URL") as info:
        open_backend(text)
    assert f"did you mean {meant!r}" in str(info.value)
    assert "no backend named" not in str(info.value)
