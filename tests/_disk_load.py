"""A loaded disk for tests and benchmarks: competing writer processes on the same filesystem.

``competing_writers(directory)`` starts processes that each rewrite a 1 MiB file and ``fsync``
it, over and over, in ``directory``, until the block ends. Everything else on that filesystem
then waits on the device and its journal as it would beside another tenant's heavy writes:
contention, not a latency injected per call. (cgroup ``io.max`` on a loop device throttles more
exactly, but needs cgroup v2 and root; a competing writer works wherever the tests run.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the writer: rewrite and fsync one file forever; touch ``<file>.ready`` after the first one
_WRITER = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
data = os.urandom(size)
first = True
while True:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    if first:
        open(path + ".ready", "w").close()
        first = False
"""

#: how long a writer may take to start (an interpreter's start on a busy machine)
START_S = 60.0


@contextmanager
def competing_writers(directory: Path, processes: int = 2, nbytes: int = 1 << 20) -> Iterator[None]:
    """Load the filesystem of ``directory`` with ``processes`` writers (see the module
    docstring) while the block runs; the block starts once each has written once."""
    directory.mkdir(parents=True, exist_ok=True)
    files = [directory / f"writer-{i}" for i in range(processes)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(f), str(nbytes)]) for f in files
    ]
    try:
        started = time.monotonic()
        while not all(Path(f"{f}.ready").exists() for f in files):
            dead = [p.args for p in procs if p.poll() is not None]
            assert not dead, f"a competing writer exited: {dead}"
            assert time.monotonic() - started < START_S, "the competing writers did not start"
            time.sleep(0.05)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
