"""The conformance suite catches broken backends: each mutant of ``sqlite_mutants`` fails it,
and the correct SQLite backend passes it.

The suite runs in a separate pytest process (a generated test module, one class per backend,
in pytest-asyncio's default strict mode), and its JUnit report tells which tests failed per
class. The correct backend runs the whole suite and must pass all of it (so the harness and the
backend are sound); each mutant runs the suite test that guards its defect and must fail it.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from .sqlite_mutants import MUTANTS

HERE = Path(__file__).resolve().parent

MODULE = '''
import pytest
import pytest_asyncio

from hicache_store.testing import BackendTests
from sqlite_mutants import MUTANTS, SqliteBackend


class _Sqlite(BackendTests):
    cls = SqliteBackend
    call_timeout_s = 3.0  # the hanging mutant must fail fast
    key_timeout_s = 0.01
    stateful_max_examples = 5

    @pytest_asyncio.fixture
    async def backend(self, tmp_path):
        store = self.cls(str(tmp_path / "kv.sqlite"))
        yield store
        await store.close()

    async def oracle_get(self, backend, key):
        return backend.raw_get(key)

    async def oracle_set(self, backend, key, data):
        backend.raw_set(key, data)

    async def reopen(self, backend):
        return self.cls(backend.path)


class TestCorrect(_Sqlite):
    pass

'''


@pytest.mark.slow
def test_every_mutant_fails_the_suite_and_the_correct_backend_passes(tmp_path: Path) -> None:
    classes = "".join(
        f"class TestMutant_{name}(_Sqlite):\n    cls = MUTANTS[{name!r}][0]\n\n\n"
        for name in MUTANTS
    )
    (tmp_path / "test_generated.py").write_text(MODULE + "\n" + classes)
    # The correct backend runs the whole suite; each mutant the test guarding its defect.
    selection = " or ".join(["TestCorrect", *(f"(TestMutant_{name} and {guard})"
                                              for name, (_, guard) in MUTANTS.items())])
    report = tmp_path / "report.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         f"--junitxml={report}", "-o", "asyncio_default_fixture_loop_scope=function",
         "-k", selection, "test_generated.py"],
        cwd=tmp_path, env={**_env(), "PYTHONPATH": str(HERE)}, capture_output=True, text=True,
        timeout=600, check=False,
    )
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    failed: dict[str, set[str]] = defaultdict(set)
    ran: dict[str, int] = defaultdict(int)
    for case in ET.parse(report).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "").split("[")[0]
        ran[cls] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed[cls].add(name)
    assert ran["TestCorrect"] > 100, dict(ran)
    assert failed["TestCorrect"] == set(), result.stdout[-5000:]
    for name, (_cls, guard) in MUTANTS.items():
        assert ran[f"TestMutant_{name}"] >= 1, f"mutant {name}: {guard} did not run"
        assert failed[f"TestMutant_{name}"] == {guard}, f"mutant {name} passed {guard}"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
