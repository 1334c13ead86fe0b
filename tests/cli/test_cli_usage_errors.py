"""Bad arguments are usage errors: one line saying what is valid, exit 2, found before any work.

Real processes of the installed console script: a mistyped store URL, a ``--namespace`` that is
no digest or that the store does not hold; and the library's own errors for the same mistakes
(``KVReader``) are the documented classes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_store import sync
from hicache_store.backends import open_backend
from hicache_store.errors import (
    ConfigError,
    HiCacheStoreError,
    InvalidNamespaceError,
    UnknownNamespaceError,
)
from hicache_store.layout.namespace import Grid
from hicache_store.layout.topology import Topology
from hicache_store.reader import KVReader

CLI = [str(Path(sys.executable).with_name("hicache-store"))]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_STORE_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300, check=False)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(("url", "hint"), [
    ("/srv/kv", "did you mean 'file:///srv/kv'"),
    ("file:/srv/kv", "did you mean 'file:///srv/kv'"),
    ("fiel:///srv/kv", "did you mean 'file'"),
])
@pytest.mark.parametrize("command", [["inspect"], ["serve-query", "--namespace", "0" * 16]])
def test_a_mistyped_url_is_usage_with_what_was_meant(
    tmp_path: Path, command: list[str], url: str, hint: str
) -> None:
    result = run([command[0], url, *command[1:]], tmp_path)
    line = one_line(result.stderr)
    assert result.returncode == 2, result.stderr
    assert hint in line, line


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A file store holding one prepopulated namespace: (url, its digest)."""
    from hicache_store.demo.engine.source import MiniEngineSource
    from hicache_store.ops.prepopulate import namespace_for, prepopulate

    source = MiniEngineSource("tiny")
    url = f"file://{tmp_path_factory.mktemp('s') / 'kv'}"
    namespace = namespace_for(source, page_size=4, grid=Grid(1, 1))
    backend = open_backend(url)
    sync.run(prepopulate(backend, source, [list(range(1, 33))], namespace, Topology(1, 1)))
    sync.close(backend)
    return url, namespace.digest


def test_inspect_of_a_namespace_that_is_no_digest_is_usage(
    tmp_path: Path, store: tuple[str, str]
) -> None:
    url, _digest = store
    result = run(["inspect", url, "--namespace", "abc"], tmp_path)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "'abc' is not a namespace digest (16 hex digits)" in line
    assert result.stdout == ""


def test_inspect_of_a_namespace_the_store_does_not_hold_names_those_it_does(
    tmp_path: Path, store: tuple[str, str]
) -> None:
    url, digest = store
    result = run(["inspect", url, "--namespace", "0123456789abcdef", "--no-progress"], tmp_path)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "holds no namespace 0123456789abcdef" in line and digest in line
    assert result.stdout == ""
    held = run(["inspect", url, "--namespace", digest, "--no-progress"], tmp_path)
    assert held.returncode == 0, held.stderr
    assert held.stdout.startswith("1 namespace, ")  # one, not "1 namespaces"


def test_the_readers_errors_are_the_documented_classes(store: tuple[str, str]) -> None:
    url, _digest = store
    with KVReader(url, "abc") as reader, pytest.raises(InvalidNamespaceError) as bad:
        reader.stored_pages(list(range(8)))
    assert isinstance(bad.value, ValueError)  # what callers caught before
    with KVReader(url, "0123456789abcdef") as reader, \
            pytest.raises(UnknownNamespaceError, match="no manifest") as missing:
        reader.stored_pages(list(range(8)))
    assert isinstance(missing.value, LookupError) and isinstance(missing.value, HiCacheStoreError)
    with pytest.raises(ConfigError):
        KVReader("fiel:///x", "0123456789abcdef")


def test_every_exception_of_the_layers_is_exported_for_users() -> None:
    # ``hicache_store.errors`` is the one place users import exceptions from: a class a layer
    # defines and raises but this module does not name is one users cannot catch by name.
    import inspect

    import hicache_store.errors as public
    from hicache_store.backends import errors as backend_errors
    from hicache_store.layout import errors as layout_errors

    defined = {name for module in (backend_errors, layout_errors)
               for name, obj in vars(module).items()
               if inspect.isclass(obj) and issubclass(obj, Exception)
               and obj.__module__ == module.__name__ and not name.startswith("_")}
    assert defined, "no exception classes found: the test reads the wrong modules"
    assert defined - set(public.__all__) == set()
    for name in defined:
        assert getattr(public, name) is getattr(backend_errors, name, None) or getattr(
            public, name) is getattr(layout_errors, name, None)
