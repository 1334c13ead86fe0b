"""``hicache-store tenant-key``: make, rotate and retire a tenant key ring (``hicache_store.tenant``).

::

    hicache-store tenant-key new /etc/hicache/tenant.keys      # a ring with one active key
    hicache-store tenant-key rotate /etc/hicache/tenant.keys   # new active key; old one reads
    hicache-store tenant-key retire /etc/hicache/tenant.keys KEY_ID
    hicache-store tenant-key show /etc/hicache/tenant.keys     # key ids and states only

Files are written whole (a temporary file in the same folder, mode 0600, then renamed), so a
reader never sees half a ring. ``new`` refuses to overwrite a file. Secrets are never printed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hicache_store.commands._common import add_command
from hicache_store.errors import UsageError
from hicache_store.tenant import (
    new_ring_text,
    parse_key_ring,
    read_key_file,
    retire_text,
    rotate_text,
)


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "tenant-key", doc=__doc__,
                         help="make, rotate and retire a tenant key ring (sealed namespaces)")
    parser.add_argument("action", choices=["new", "rotate", "retire", "show"])
    parser.add_argument("path", help="the key ring file")
    parser.add_argument("key_id", nargs="?", help="retire: the key id to retire")
    parser.set_defaults(func=run)


def _write(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def run(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser()
    if (args.key_id is not None) != (args.action == "retire"):
        raise UsageError("give a key id with 'retire' and only there")
    try:
        if args.action == "new":
            if path.exists():
                raise UsageError(f"{path} exists; 'rotate' changes a ring")
            _write(path, new_ring_text())
        elif args.action in ("rotate", "retire"):
            read_key_file(path)  # checks the file before it is rewritten
            text = path.read_text(encoding="ascii")
            if args.action == "rotate":
                _write(path, rotate_text(text, str(path)))
            else:
                _write(path, retire_text(text, args.key_id, str(path)))
        ring = parse_key_ring(path.read_text(encoding="ascii"), str(path))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"active  {ring.active.key_id}")
    for key in ring.readable[1:]:
        print(f"read    {key.key_id}")
    for key_id in sorted(ring.retired):
        print(f"retired {key_id}")
    return 0
