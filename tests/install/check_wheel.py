"""The install check of ``make test``: hicache-store as users install it, outside the checkout.

For three Pythons: the one running this (the project's ``.venv``: torch 2.13.0 from the local
CPU wheel), and the oldest and the newest the package supports (the ``Programming Language ::
Python :: 3.X`` classifiers of ``pyproject.toml``; found as ``python3.X`` on PATH or under
pyenv's ``versions/3.X.*``, and a missing one fails the check naming where it looked):

1. copy the checkout's files (tracked and untracked, not ignored; no tests) to a scratch
   folder and build the wheel there (``pip wheel``, build isolation, pip's cache);
2. install it into a fresh venv with its runtime dependencies (from the package index) and the
   ``file`` extra (and ``testing`` where the conformance suite runs); on the main Python
   torch first (``link_torch``: this venv's torch 2.13.0, linked, with its dependencies);
3. from a folder outside the checkout, ``smoke.py``: the package is the venv's, every module
   imports (one that needs an optional package the venv lacks is listed, not failed), the
   quickstart page's ``python`` blocks run (``docs/getting-started/quickstart.md``; one that needs
   a package the venv lacks is listed as not run), ``hicache-store --help`` and every subcommand's;
4. on the oldest and newest Python, the backend conformance suite on the file backend.

torch 2.13.0 for those two comes from the package index only as the CUDA build (about 3 GiB
with its NVIDIA libraries), so they run without torch and say what that left out. Prints one
section per Python; exit code 1 on any failure.

    .venv/bin/python tests/install/check_wheel.py [--work DIR] [--only main|oldest|newest]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: top-level paths of the checkout a wheel is built from (the rest is tests and benchmarks).
SOURCE = ("pyproject.toml", "setup.py", "README.md", "hicache_store", "layout", "kernels",
          "backends")


class CheckFailed(Exception):
    pass


def environment() -> dict[str, str]:
    """This process's environment without what would point a child at the checkout or at this
    venv."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
            and not k.startswith(("PYTEST_", "HICACHE_STORE_"))}


def run(cmd: list[str], cwd: Path, *, timeout: float = 1200) -> str:
    """Run ``cmd``; its stdout, or ``CheckFailed`` with the end of its output."""
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=environment(),
                            capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise CheckFailed(f"{' '.join(map(str, cmd))}: exit {result.returncode}\n"
                          f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def supported_pythons() -> tuple[str, str]:
    """The oldest and newest ``3.X`` of pyproject's classifiers."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    versions = sorted(
        tuple(int(p) for p in m.group(1).split(".")) for c in project.get("classifiers", [])
         if (m := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", c)))
    if not versions:
        raise CheckFailed("pyproject.toml names no 'Programming Language :: Python :: 3.X'")
    low, high = versions[0], versions[-1]
    return f"{low[0]}.{low[1]}", f"{high[0]}.{high[1]}"


def find_python(version: str) -> str:
    """An interpreter of ``version`` (``3.X``): ``python3.X`` on PATH, else the newest
    ``versions/3.X.*`` of pyenv (``$PYENV_ROOT``, ``~/.pyenv``)."""
    candidates = []
    if found := shutil.which(f"python{version}"):
        candidates.append(found)
    roots = [os.environ.get("PYENV_ROOT"), str(Path.home() / ".pyenv")]
    for root in filter(None, roots):
        installs = sorted(Path(root, "versions").glob(f"{version}.*"),
                          key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)],
                          reverse=True)
        candidates += [str(p / "bin" / "python") for p in installs]
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print(*sys.version_info[:2], "
                                "sep='.')"], capture_output=True, text=True, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    raise CheckFailed(
        f"Python {version} (supported, per pyproject's classifiers) is not installed: looked "
        f"for python{version} on PATH and {' and '.join(f'{r}/versions/{version}.*' for r in filter(None, roots))}; "
        f"install it (e.g. `pyenv install {version}`)")


def copy_source(dest: Path) -> None:
    """The checkout's files a wheel is built from: tracked and untracked-not-ignored ones."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", *SOURCE],
                            cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        raise CheckFailed(f"git ls-files failed in {ROOT}: {listed.stderr.decode()[-1000:]}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def quick_tour(dest: Path) -> list[Path]:
    """The quickstart's ``python`` blocks (``docs/getting-started/quickstart.md``), one file
    each."""
    text = (ROOT / "docs" / "getting-started" / "quickstart.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    if not blocks:
        raise CheckFailed("the quickstart page has no python block")
    dest.mkdir(parents=True)
    paths = []
    for i, block in enumerate(blocks):
        path = dest / f"tour_{i:02d}.py"
        path.write_text(block)
        paths.append(path)
    return paths


def link_torch(vpy: Path, cwd: Path) -> None:
    """torch 2.13.0 in the venv of ``vpy``: the files of this venv's installation of the same
    local wheel, hard-linked (unpacking the wheel again costs minutes on a busy machine), then
    its own dependencies installed by pip."""
    dist = importlib.metadata.distribution("torch")
    if dist.version.split("+")[0] != "2.13.0":
        raise CheckFailed(f"this venv has torch {dist.version}, not 2.13.0 (make setup)")
    site = Path(run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd).strip())
    for name in dist.files or ():
        if ".." in name.parts:
            continue  # console scripts: not needed
        source, target = Path(str(dist.locate_file(name))), site / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:  # another filesystem
            shutil.copy2(source, target)
    needs = [str(r) for r in dist.requires or () if "extra ==" not in str(r)]
    run([vpy, "-m", "pip", "install", "-q", *needs], cwd)


def check(label: str, python: str, work: Path, *, torch: bool, conformance: bool) -> None:
    """Build, install and smoke-test the wheel with ``python`` (see the module docstring)."""
    started = time.monotonic()
    here = work / label
    venv = here / "venv"
    run([python, "-m", "venv", venv], work)  # its own pip (ensurepip)
    vpy = venv / "bin" / "python"
    version = run([vpy, "-c", "import platform; print(platform.python_version())"], work).strip()
    print(f"== Python {version} ({label}): {python}", flush=True)
    source = here / "src"
    copy_source(source)
    run([vpy, "-m", "pip", "wheel", "-q", "--no-deps", "-w", here / "dist", source], here)
    (wheel,) = (here / "dist").glob("hicache_store-*.whl")
    if torch:
        link_torch(vpy, here)
    extras = "file,testing" if conformance else "file"
    run([vpy, "-m", "pip", "install", "-q", f"{wheel}[{extras}]"], here)
    print(f"  built and installed {wheel.name}"
          + ("" if torch else " (without torch: not installable here for this Python)"),
          flush=True)
    snippets = quick_tour(here / "tour")
    smoke = here / "smoke.py"
    shutil.copy2(HERE / "smoke.py", smoke)
    print(run([vpy, smoke, *snippets], here), end="", flush=True)
    if conformance:
        suite = here / "conformance"
        suite.mkdir()
        shutil.copy2(HERE / "conformance_file.py", suite / "test_file_conformance.py")
        out = run([vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "test_file_conformance.py"], suite, timeout=1800)
        print(f"  conformance suite on the file backend: {out.strip().splitlines()[-1]}")
    print(f"  {time.monotonic() - started:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one, "
                        "removed afterwards)")
    parser.add_argument("--only", choices=["main", "oldest", "newest"], action="append",
                        help="check only these Pythons (repeatable; default: all three)")
    args = parser.parse_args(argv)
    only = set(args.only or ["main", "oldest", "newest"])
    work = args.work or Path(tempfile.mkdtemp(prefix="hicache-store-install-"))
    work.mkdir(parents=True, exist_ok=True)
    if ROOT in work.resolve().parents or work.resolve() == ROOT:
        parser.error("--work must be outside the checkout")
    try:
        oldest, newest = supported_pythons()
        plan = []
        if "main" in only:
            base = getattr(sys, "_base_executable", sys.executable)
            plan.append(("main", base, True, False))
        for label, version in (("oldest", oldest), ("newest", newest)):
            if label in only:
                plan.append((label, find_python(version), False, True))
        for label, python, torch, conformance in plan:
            check(label, python, work, torch=torch, conformance=conformance)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"install check FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"install check passed: {', '.join(label for label, *_ in plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
