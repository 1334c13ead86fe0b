"""Smoke checks of an installed hicache-store, run by ``check_wheel.py`` inside a scratch venv,
from a folder outside the checkout (stdlib only; no test framework).

``python smoke.py SNIPPET...``:

1. the package imported is the installed one (under this venv), not a checkout's;
2. every module of it imports. A module that fails with ``ModuleNotFoundError`` for an optional
   package (``OPTIONAL``, the extras' packages) that this venv lacks is reported as skipped with
   that package's name; any other failure, a missing ``hicache_store`` module above all, fails;
3. the framed-object path's deadlines (``object_path``);
4. each snippet file runs in a fresh interpreter (the quickstart page's python blocks); a snippet that
   imports an optional package this venv lacks is reported as not run;
5. ``hicache-store --help`` and each subcommand's ``--help`` exit 0.

Prints what ran and what did not; exit code 1 on any failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
import traceback
from pathlib import Path

#: top-level names of the optional packages (the extras, SGLang, vLLM) a module may need.
OPTIONAL = frozenset({
    "torch", "triton", "boto3", "botocore", "aiobotocore", "s3fs", "fsspec", "aiofiles",
    "mooncake", "prometheus_client", "matplotlib", "transformers", "tokenizers",
    "cryptography", "zmq", "sglang", "vllm", "hf3fs_fuse", "hf3fs_py_usrbio", "pytest",
    "pytest_asyncio", "hypothesis", "safetensors", "huggingface_hub", "numba",
})


def check_location() -> list[str]:
    import hicache_store

    where = Path(hicache_store.__file__).resolve()
    if Path(sys.prefix).resolve() not in where.parents:
        return [f"hicache_store imported from {where}, not from this venv ({sys.prefix})"]
    return []


def import_all() -> tuple[int, dict[str, list[str]], list[str]]:
    """(modules imported, {missing optional package: modules}, failures)."""
    import hicache_store

    imported = 0
    skipped: dict[str, list[str]] = {}
    failures: list[str] = []
    names = ["hicache_store"] + [
        # a package that fails to import is reported by the loop below, with its reason
        info.name for info in pkgutil.walk_packages(hicache_store.__path__, "hicache_store.",
                                                    onerror=lambda name: None)]
    for name in names:
        if name.endswith(".__main__"):
            continue  # ``python -m hicache_store``: runs the CLI (checked by ``cli_help``)
        try:
            importlib.import_module(name)
            imported += 1
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if top in OPTIONAL:
                skipped.setdefault(top, []).append(name)
            else:
                failures.append(f"{name}: {exc!r}")
        except Exception:
            failures.append(f"{name}: {traceback.format_exc(limit=3)}")
    return imported, skipped, failures


def needs(snippet: str) -> list[str]:
    """The optional packages a snippet imports that this venv lacks."""
    wanted = set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", snippet, flags=re.M))
    return sorted(name for name in wanted & OPTIONAL if importlib.util.find_spec(name) is None)


def run_snippets(paths: list[Path]) -> tuple[int, list[str], list[str]]:
    """(snippets run, not run with why, failures)."""
    ran, not_run, failures = 0, [], []  # a snippet's missing optional package: found
    # statically (its own imports) or from the error of a run that imported it further down
    for path in paths:
        missing = needs(path.read_text())
        if missing:
            not_run.append(f"{path.name} (needs {', '.join(missing)})")
            continue
        folder = path.parent / f"{path.stem}.run"
        folder.mkdir(exist_ok=True)
        result = subprocess.run([sys.executable, str(path.resolve())], cwd=folder,
                                capture_output=True, text=True, timeout=900, check=False)
        absent = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'\s*$", result.stderr)
        if absent and absent.group(1).split(".")[0] in OPTIONAL:  # imported further down
            not_run.append(f"{path.name} (needs {absent.group(1).split('.')[0]})")
            continue
        if result.returncode != 0 or "Traceback" in result.stderr:
            failures.append(f"{path.name}: exit {result.returncode}\n{result.stderr[-3000:]}")
        ran += 1
    return ran, not_run, failures


def object_path() -> list[str]:
    """The framed-object path's deadlines (``ObjectIO.put`` under ``timeout_at``, backend calls
    under ``wait_for``), torch-free: a put that misses its deadline is False and stores
    nothing readable; one that makes it reads back equal."""
    import asyncio

    import numpy as np

    from hicache_store.backends import open_backend
    from hicache_store.backends.faulty import FaultConfig, FaultyBackend
    from hicache_store.layout.keys import ObjectCoords, ObjectKey
    from hicache_store.layout.namespace import Grid, ModelShape, Namespace
    from hicache_store.objects import Frame, ObjectIO

    ns = Namespace.create("m", ModelShape.mha(4, 2, 8), "float16", 4, Grid(4, 2))
    key = ObjectKey("ab" * 32, ns.digest, ObjectCoords(0, 4, 0))
    payload = 4 * 2 * 4 * 2 * 8 * 2

    async def go() -> list[str]:
        store = FaultyBackend(open_backend("memory://"))
        io = ObjectIO(store, ns, io_timeout_s=0.05, min_bandwidth_mib_s=1e6)
        header = io.header_bytes(4)
        frame = memoryview(bytearray(header + payload))
        np.frombuffer(frame, dtype=np.uint8)[header:] = 7
        store.faults = FaultConfig(latency_s=1.0)
        late = await io.put([Frame(key, frame)])
        store.faults = FaultConfig()
        found = [f"a put past its deadline reported {late}"] if late != [False] else []
        await asyncio.sleep(1.1)  # the cut put's I/O ends (it may land: never reported True)
        if await io.put([Frame(key, frame)]) != [True]:
            found.append("a put within its deadline was not stored")
        out = np.zeros(payload, dtype=np.uint8)
        if await io.read_blocks(key, out.data, payload_bytes=payload) is None or (out != 7).any():
            found.append("the stored object did not read back equal")
        await store.close()
        return found

    return asyncio.run(go())


def cli_help() -> tuple[int, list[str]]:
    script = Path(sys.executable).with_name("hicache-store")
    failures = []
    top = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300,
                         check=False)
    if top.returncode != 0:
        return 0, [f"hicache-store --help: exit {top.returncode}\n{top.stderr[-2000:]}"]
    listing = top.stdout.partition("positional arguments:")[2].partition("options:")[0]
    names = re.findall(r"^    ([a-z][a-z-]*)\b", listing, flags=re.M)
    if not names:
        failures.append(f"hicache-store --help lists no commands:\n{top.stdout}")
    for name in names:
        result = subprocess.run([str(script), name, "--help"], capture_output=True, text=True,
                                timeout=300, check=False)
        if result.returncode != 0:
            failures.append(f"hicache-store {name} --help: exit {result.returncode}\n"
                            f"{result.stderr[-2000:]}")
    return 1 + len(names), failures


def main(argv: list[str]) -> int:
    failures = check_location()
    imported, skipped, failed = import_all()
    failures += failed
    print(f"  imported {imported} modules", flush=True)
    for package, modules in sorted(skipped.items()):
        print(f"  not imported (needs {package}, not installed here): {', '.join(modules)}")
    failed = object_path()
    failures += failed
    print("  the object path's deadlines: " + ("FAILED" if failed else "ok"))
    ran, not_run, failed = run_snippets([Path(p) for p in argv])
    failures += failed
    print(f"  ran {ran} of {len(argv)} quick-tour snippets"
          + (f"; not run: {'; '.join(not_run)}" if not_run else ""))
    helps, failed = cli_help()
    failures += failed
    print(f"  hicache-store --help: {helps} commands' help")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)
    sys.exit(main(sys.argv[1:]))
