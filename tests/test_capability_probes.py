"""Optional backend abilities are declared capabilities, never found by probing (the source).

Two rules, checked on every source file (AST), each shown to catch a planted violation:

* Above ``backends/`` no ``getattr`` / ``hasattr`` looks for a backend's ability: none names
  an attribute of ``Backend`` or one of the abilities a backend used to be probed for, and
  none probes an object named a backend or a store. A caller asks ``capabilities`` and the
  accessor (``backends.protocols``).
* Nowhere in the library is a method compared by identity (``type(x).m is C.m``,
  ``getattr(x.m, "__func__")``): a subclass's override is no way to choose a behaviour; the
  file family's engines are chosen at open (``backends._file_io``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_layering import PACKAGES, ROOT, source_modules

from hicache_store.backends import Backend

#: abilities callers once found with getattr or an identity check, besides Backend's own names.
PROBED = frozenset({
    "register_host_buffer", "unregister_host_buffer", "allocate_host_buffer", "exists_now",
    "exists_blocking", "start_get_into_summed", "get_into_summed", "sums_reads", "path_of",
    "change_feed",
})


def _backend_names() -> frozenset[str]:
    """Backend's methods, and the abilities once probed for."""
    return frozenset(name for name in dir(Backend)
                     if not name.startswith("__") and callable(getattr(Backend, name))) | PROBED


def _text(node: ast.AST) -> str:
    return ast.unparse(node).lower()


def _probes(tree: ast.AST, names: frozenset[str]) -> Iterator[int]:
    """Lines of ``hasattr`` calls, and ``getattr`` calls with a default (what is absent is
    then expected), that look for a backend ability."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                (node.func.id == "hasattr" and len(node.args) == 2)
                or (node.func.id == "getattr" and len(node.args) == 3))):
            continue
        target, name = node.args[0], node.args[1]
        literal = name.value if isinstance(name, ast.Constant) else None
        if literal in names or "backend" in _text(target) or "store" in _text(target):
            yield node.lineno


def _is_method_ref(node: ast.AST) -> bool:
    """``type(x).m``, ``Class.m`` or ``x.m.__func__`` (a method, not an enum member)."""
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "__func__":
        return True
    owner = node.value
    method_like = node.attr[:1].islower() or node.attr.startswith("_")
    of_a_class = (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                  and owner.func.id == "type") or (
                      isinstance(owner, ast.Name) and owner.id[:1].isupper())
    return method_like and of_a_class


def _identity_checks(tree: ast.AST) -> Iterator[int]:
    """Lines that compare methods by identity, or reach for a bound method's function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            if any(_is_method_ref(operand) for operand in (node.left, *node.comparators)):
                yield node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__func__"):
            yield node.lineno


def violations(root: Path) -> list[str]:
    names = _backend_names()
    found: list[str] = []
    for module, path in source_modules(root):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root)
        if not module.startswith(("hicache_store.backends", "hicache_store.layout",
                                  "hicache_store.kernels")):
            found += [f"{where}:{line}: a getattr probe for a backend ability"
                      for line in _probes(tree, names)]
        found += [f"{where}:{line}: a method compared by identity"
                  for line in _identity_checks(tree)]
    return found


def test_no_probe_for_a_backend_ability_and_no_method_identity_check() -> None:
    assert violations(ROOT) == []


def test_the_checks_catch_each_kind_of_probe(tmp_path: Path) -> None:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    tier = tmp_path / "hicache_store" / "tier"
    tier.mkdir()
    (tier / "cache.py").write_text(
        "def offer(backend, pool):\n"
        "    register = getattr(backend, 'register_host_buffer', None)\n"  # 2
        "    return register(pool)\n"
        "def lookups(tier):\n"
        "    return hasattr(tier.store, 'anything')\n"  # 5
        "def fine(args):\n"
        "    return getattr(args, 'config', None)\n")
    (tier / "vllm.py").write_text(
        "from hicache_store.backends import Backend\n"
        "def answers_now(backend):\n"
        "    return type(backend).exists_now is not Backend.exists_now\n"  # 3
        "def enum_member(x, HitRule):\n"
        "    return x is HitRule.CHECKPOINT\n")
    (tmp_path / "backends" / "file.py").write_text(
        "class FileBackend:\n"
        "    def released(self):\n"
        "        return getattr(self._write_one, '__func__', None) is FileBackend._write_one\n")
    found = violations(tmp_path)
    assert found == [
        "backends/file.py:3: a method compared by identity",
        "backends/file.py:3: a method compared by identity",
        "hicache_store/tier/cache.py:2: a getattr probe for a backend ability",
        "hicache_store/tier/cache.py:5: a getattr probe for a backend ability",
        "hicache_store/tier/vllm.py:3: a method compared by identity",
    ], found
