"""The import layering of the library (ARCHITECTURE.md), checked on the source, not assumed.

* ``layout`` imports no other part of the library; ``kernels`` and ``backends`` import only
  ``layout`` (and themselves).
* The demo and benchmark harness (``hicache_store.demo``: the mini engine, the benchmark drivers,
  the hybrid and draft mini models, rank launchers) is outside the core: no core module imports
  it, not even lazily inside a function. Only the command modules that deliberately drive it
  (``DEMO_COMMANDS``) may, and they too only inside their ``run`` functions, so importing any
  module of the library (``hicache-store --help`` included) never loads the demo.
* Library logic lives below the commands: nothing outside ``commands/`` and ``cli.py`` imports
  them, and no command imports the dispatcher (``cli``, ``__main__``: what commands share is
  ``commands/_common.py``); the tier, the object I/O and the rank group (``tier``, ``objects``,
  ``distributed``), and the SGLang extra-config both tools read (``sglang_config``), import
  neither the operator tools (``ops``) nor the engine adapters (``integrations``); ``ops`` never
  imports ``integrations`` (what both need lives below them).
* The cache tier's request protocol (``tier.cache``: ``HiCache``) stands above its
  collaborators: no other module of ``tier`` imports it (the package's ``__init__`` re-exports
  it). The collaborators are built with the residency primitives (``tier.residency``) instead.
* Above ``backends/``, only the storage layer's public contract: no module of the library
  outside ``layout``, ``kernels`` and ``backends`` imports a concrete file backend
  (``backends.file``, ``backends.hf3fs``) or a private module of ``backends`` (``backends._*``).
  Optional abilities are declared capabilities (``Capabilities``) with small protocols
  (``backends.protocols``), never found by a backend's concrete type.
* No import cycle between packages: the units are ``layout``, ``kernels``, ``backends``, each
  subpackage of ``hicache_store`` (``tier``, ``ops``, ``integrations``, ...), each top-level module
  (``reader``, ``sync``, ...) and the root package itself; an import from one unit into another is
  an edge, and no edge may close a loop (``ops -> integrations -> ops`` included). A lazy import
  (inside a function) counts like any other: it runs the moment the function does, and a loop
  through one means the two packages cannot be understood, tested or moved apart.

Two checks: every import statement of every source file, wherever it stands (module level,
inside a function or ``TYPE_CHECKING`` block; AST, relative imports resolved,
``importlib.import_module("...")`` literals included), and a fresh interpreter that imports
every non-demo module and then inspects ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as (setup.py ``PACKAGE_DIR``).
PACKAGES = {
    "layout": "hicache_store.layout",
    "kernels": "hicache_store.kernels",
    "backends": "hicache_store.backends",
    "hicache_store": "hicache_store",
}
DEMO = "hicache_store.demo"
#: command modules that exist to drive the demo (benchmarks, ``prepopulate --mini-engine``).
DEMO_COMMANDS = frozenset({
    "hicache_store.commands.bench_multiturn",
    "hicache_store.commands.bench_pd",
    "hicache_store.commands.bench_trace",
    "hicache_store.commands.prepopulate",
})
COMMAND_LAYER = ("hicache_store.commands", "hicache_store.cli", "hicache_store.__main__")
DISPATCHER = ("hicache_store.cli", "hicache_store.__main__")
#: the cache tier and what it stands on (with the SGLang extra-config, which the tools share), and
#: what stands on them (operator tools, engine adapters).
TIER_LAYER = ("hicache_store.tier", "hicache_store.objects", "hicache_store.distributed",
              "hicache_store.sglang_config")
TOOL_LAYER = ("hicache_store.ops", "hicache_store.integrations")
#: the tier's request protocol, and the tier modules that may import it (the package's face).
TIER_PROTOCOL = "hicache_store.tier.cache"
TIER_PROTOCOL_IMPORTERS = frozenset({"hicache_store.tier", TIER_PROTOCOL})
#: the storage layer's concrete backends that nothing above it may name (their abilities are
#: capabilities of ``Backend``).
CONCRETE_BACKENDS = ("hicache_store.backends.file", "hicache_store.backends.hf3fs")
#: private imports from above ``backends/`` still allowed, each with the work that removes it
#: (none now).
PRIVATE_ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _lower_layer(module: str) -> str | None:
    """``hicache_store.kernels`` / ``hicache_store.backends`` for their modules, else None."""
    for layer in ("hicache_store.kernels", "hicache_store.backends"):
        if _under(module, layer):
            return layer
    return None


def _below_the_contract(name: str) -> bool:
    """Whether ``name`` is a module of ``backends`` that only ``backends`` may import: a
    private one (``backends._x``) or a concrete file backend."""
    if not _under(name, "hicache_store.backends") or name == "hicache_store.backends":
        return False
    first = name.split(".")[2]
    return first.startswith("_") or any(_under(name, c) for c in CONCRETE_BACKENDS)


def source_modules(root: Path) -> Iterator[tuple[str, Path]]:
    """Every library module under ``root``: ``(dotted name, file)``, packages as ``__init__``."""
    for folder, package in PACKAGES.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def imported_names(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``path``, wherever it stands."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = ".".join(anchor[: len(anchor) - drop])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # ``from hicache_store import demo`` imports a module
                yield node.lineno, f"{target}.{alias.name}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def violations(root: Path) -> list[str]:
    """Every import that breaks the layering, as ``file:line: importer -> imported (rule)``."""
    found: list[str] = []
    for module, path in source_modules(root):
        where = path.relative_to(root)
        flagged: set[int] = set()  # one report per import statement
        for line, name in imported_names(module, path):
            if line in flagged or not _under(name, "hicache_store"):
                continue
            rule = None
            if _under(module, "hicache_store.layout") and not _under(name, "hicache_store.layout"):
                rule = "layout imports nothing above it"
            elif (own := _lower_layer(module)) and not (
                    _under(name, "hicache_store.layout") or _under(name, own)):
                rule = "kernels and backends import only layout"
            elif _under(name, DEMO) and not _under(module, DEMO) and module not in DEMO_COMMANDS:
                rule = "the core never imports the demo"
            elif _under(module, "hicache_store.commands") \
                    and any(_under(name, d) for d in DISPATCHER):
                rule = "commands never import the dispatcher"
            elif any(_under(name, c) for c in COMMAND_LAYER) \
                    and not any(_under(module, c) for c in COMMAND_LAYER):
                rule = "library modules never import the commands"
            elif any(_under(module, c) for c in TIER_LAYER) \
                    and any(_under(name, t) for t in TOOL_LAYER):
                rule = "the tier and object I/O never import the operator tools or adapters"
            elif _under(module, "hicache_store.ops") and _under(name, "hicache_store.integrations"):
                rule = "the operator tools never import the engine adapters"
            elif _under(module, "hicache_store.tier") and _under(name, TIER_PROTOCOL) \
                    and module not in TIER_PROTOCOL_IMPORTERS:
                rule = "the tier's collaborators never import its request protocol (tier.cache)"
            elif not _lower_layer(module) and _below_the_contract(name) and not any(
                    module == m and _under(name, n) for m, n in PRIVATE_ALLOWED):
                rule = ("above backends/, only their public contract: no concrete file "
                        "backend, no private module")
            if rule:
                flagged.add(line)
                found.append(f"{where}:{line}: {module} -> {name} ({rule})")
    return found


def _unit(name: str, modules: set[str]) -> str:
    """The package (cycle-check unit) a library module or imported name belongs to."""
    parts = name.split(".")
    unit = ".".join(parts[:2])
    # ``from hicache_store import X`` where X is a name, not a module: the root package
    return unit if unit in modules else "hicache_store"


def _lazy_lines(path: Path) -> set[int]:
    """Lines of the import statements that stand inside a function (run when it is called)."""
    lazy: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy.update(inner.lineno for inner in ast.walk(node)
                        if isinstance(inner, (ast.Import, ast.ImportFrom, ast.Call)))
    return lazy


def import_cycles(root: Path) -> list[str]:
    """Every import between packages that closes a loop, as
    ``file:line: importer -> imported [lazy] (loop: a -> b -> ... -> a)``."""
    sources = dict(source_modules(root))
    units = {".".join(m.split(".")[:2]) for m in sources}
    edges: dict[tuple[str, str], list[tuple[Path, int, bool]]] = {}
    for module, path in sources.items():
        lazy = _lazy_lines(path)
        here = _unit(module, units)
        for line, name in imported_names(module, path):
            if not _under(name, "hicache_store"):
                continue
            there = _unit(name, units)
            if there != here:
                edges.setdefault((here, there), []).append((path, line, line in lazy))
    graph: dict[str, set[str]] = {}
    for here, there in edges:
        graph.setdefault(here, set()).add(there)

    def path_back(start: str, goal: str) -> list[str] | None:
        """A shortest import path ``start -> ... -> goal`` (breadth first), or None."""
        came: dict[str, str | None] = {start: None}
        frontier = [start]
        while frontier:
            step: list[str] = []
            for unit in frontier:
                for nxt in sorted(graph.get(unit, ())):
                    if nxt in came:
                        continue
                    came[nxt] = unit
                    if nxt == goal:
                        chain: list[str] = [goal]
                        while (prev := came[chain[-1]]) is not None:
                            chain.append(prev)
                        return chain[::-1]
                    step.append(nxt)
            frontier = step
        return None

    found: list[str] = []
    for (here, there), sites in sorted(edges.items()):
        back = path_back(there, here)
        if back is None:
            continue
        loop = " -> ".join([here, *back])
        for path, line, lazy in sorted(set(sites)):
            found.append(f"{path.relative_to(root)}:{line}: {here} -> {there}"
                         f"{' [lazy]' if lazy else ''} (loop: {loop})")
    return found


def test_every_import_respects_the_layering() -> None:
    modules = dict(source_modules(ROOT))
    # the walk sees the whole library, or an empty result would prove nothing
    assert {"hicache_store.layout.keys", "hicache_store.backends.file", "hicache_store.tier",
            "hicache_store.ops.sources", "hicache_store.demo.engine.model",
            "hicache_store.demo.bench.multiturn"} <= modules.keys()
    assert violations(ROOT) == []


def test_the_checker_catches_each_kind_of_violation(tmp_path: Path) -> None:
    """A tree seeded with one violation per rule, written the ways imports are written."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "layout" / "keys.py").write_text("from hicache_store.tier import HiCache\n")
    (tmp_path / "kernels" / "pack.py").write_text("import hicache_store.backends.file\n")
    pkg = tmp_path / "hicache_store"
    (pkg / "ops").mkdir()
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "sources.py").write_text(
        "def mini():\n    from ..demo.engine import MiniLlama\n    return MiniLlama\n")
    (pkg / "ops" / "gc.py").write_text("from hicache_store.commands import gc\n")
    (pkg / "ops" / "deployment.py").write_text(
        "def parse():\n    from hicache_store.integrations import sglang\n    return sglang\n")
    (pkg / "tier.py").write_text(
        "import importlib\nimportlib.import_module('hicache_store.demo.bench.pd')\n")
    (pkg / "objects").mkdir()
    (pkg / "objects" / "manifest.py").write_text("from ..ops.manifest import manifest_key\n")
    (pkg / "reader.py").write_text("from hicache_store import demo\n")
    (pkg / "commands").mkdir()
    (pkg / "commands" / "bench_pd.py").write_text("from hicache_store.demo.bench import pd\n")
    (pkg / "commands" / "gc.py").write_text("from hicache_store.demo.engine import MiniLlama\n")
    (pkg / "commands" / "plan.py").write_text("from hicache_store.cli import UsageError\n")
    found = violations(tmp_path)
    assert [f.split(":")[0] for f in found] == [
        "layout/keys.py", "kernels/pack.py", "hicache_store/commands/gc.py",
        "hicache_store/commands/plan.py", "hicache_store/objects/manifest.py",
        "hicache_store/ops/deployment.py", "hicache_store/ops/gc.py",
        "hicache_store/ops/sources.py", "hicache_store/reader.py", "hicache_store/tier.py"]
    assert "hicache_store.commands.plan -> hicache_store.cli (commands never import the " \
        "dispatcher)" in found[3]
    assert "hicache_store.ops.deployment -> hicache_store.integrations (the operator tools " \
        "never import the engine adapters)" in found[5]
    assert "hicache_store.ops.sources -> hicache_store.demo.engine" in found[7]
    assert "hicache_store.objects.manifest -> hicache_store.ops.manifest" in found[4]


def test_the_checker_catches_a_tier_collaborator_importing_the_protocol(tmp_path: Path) -> None:
    """A collaborator of the tier that imports ``tier.cache`` (for a type only, or the module
    itself) is reported; the package's ``__init__`` re-exporting ``HiCache`` is not."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    tier = tmp_path / "hicache_store" / "tier"
    tier.mkdir()
    (tier / "__init__.py").write_text("from .cache import HiCache\n")
    (tier / "cache.py").write_text("from .prefetch import Prefetcher\n")
    (tier / "prefetch.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .cache import HiCache\n")
    (tier / "restore.py").write_text("from . import cache\n")
    (tier / "prefix.py").write_text("from .residency import Residency\n")
    found = violations(tmp_path)
    assert [f.split(" (")[0] for f in found] == [
        "hicache_store/tier/prefetch.py:3: hicache_store.tier.prefetch -> hicache_store.tier.cache",
        "hicache_store/tier/restore.py:1: hicache_store.tier.restore -> hicache_store.tier.cache",
    ]
    assert all("never import its request protocol" in f for f in found)


def test_nothing_above_backends_names_a_concrete_backend_or_a_private_module(
        tmp_path: Path) -> None:
    """The ways a layer above could reach below the contract, each planted once: the
    concrete file backend, hf3fs, a private index module (absolute, relative, lazy, by
    ``import_module``). The public contract (``backends``, ``backends.feed``, ...) is fine."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    pkg = tmp_path / "hicache_store"
    for sub in ("events", "commands", "integrations"):
        (pkg / sub).mkdir()
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "events" / "store.py").write_text(
        "from hicache_store.backends.file import FileBackend\n"
        "from hicache_store.backends.feed import FeedFollower\n")
    (pkg / "commands" / "events.py").write_text(
        "def run():\n    from ..backends.hf3fs import HF3FSBackend\n    return HF3FSBackend\n")
    (pkg / "integrations" / "tier.py").write_text(
        "import importlib\nimportlib.import_module('hicache_store.backends._file_index')\n"
        "from hicache_store.backends import _lru, Backend\n")
    (tmp_path / "backends" / "file.py").write_text("from ._file_index import FileIndex\n")
    found = violations(tmp_path)
    assert sorted(f.split(": ", 1)[0] for f in found) == [
        "hicache_store/commands/events.py:2", "hicache_store/events/store.py:1",
        "hicache_store/integrations/tier.py:2", "hicache_store/integrations/tier.py:3"], found
    assert all("only their public contract" in f for f in found)


def test_no_import_cycle_between_packages() -> None:
    assert import_cycles(ROOT) == []


def test_the_cycle_check_sees_lazy_imports(tmp_path: Path) -> None:
    """``ops`` imports ``integrations`` at module level, ``integrations`` imports ``ops`` inside a
    function (the loop this check was written for); both edges are reported, the lazy one so
    marked. A one-way import is not a loop."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    pkg = tmp_path / "hicache_store"
    for sub in ("ops", "integrations", "tier"):
        (pkg / sub).mkdir()
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "ops" / "deployment.py").write_text(
        "from hicache_store.integrations._config import AdapterConfig\n")
    (pkg / "integrations" / "_config.py").write_text("AdapterConfig = object\n")
    (pkg / "integrations" / "_namespace.py").write_text(
        "def check():\n    from ..ops.deployment import differences\n    return differences\n")
    (pkg / "tier" / "cache.py").write_text("from hicache_store.layout.keys import format_key\n")
    (tmp_path / "layout" / "keys.py").write_text("format_key = str\n")
    found = import_cycles(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == [
        "hicache_store/integrations/_namespace.py:2", "hicache_store/ops/deployment.py:1"]
    assert "hicache_store.integrations -> hicache_store.ops [lazy]" in found[0]
    assert "(loop: hicache_store.ops -> hicache_store.integrations -> hicache_store.ops)" \
        in found[1]


_IMPORT_ALL = """
import importlib, json, sys
loaded, skipped = [], {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.startswith("hicache_store"):
            raise
        skipped[name] = exc.name  # an optional dependency that is not installed
    else:
        loaded.append(name)
demo = sorted(m for m in sys.modules if m == "hicache_store.demo" or m.startswith("hicache_store.demo."))
print(json.dumps({"loaded": loaded, "skipped": skipped, "demo": demo}))
"""


@pytest.mark.slow
def test_importing_the_library_never_loads_the_demo() -> None:
    # every module but the demo and ``__main__`` (which runs the CLI when imported)
    names = [m for m, _ in source_modules(ROOT)
             if not _under(m, DEMO) and m != "hicache_store.__main__"]
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, json.dumps(names)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["demo"] == [], f"imported at import time: {result['demo']}"
    # the modules that drive the demo were imported too (lazily importing it), as was the core
    assert DEMO_COMMANDS | {"hicache_store.cli", "hicache_store.tier", "hicache_store.ops.sources",
                            "hicache_store.distributed"} <= set(result["loaded"])
