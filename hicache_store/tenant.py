"""Tenant key rings: which keys seal new objects, which still read, which are retired.

A tenant that shares a store with others configures a *key ring* (a small text file, mode
0600, kept like any other credential). With one, the tenant's namespace is sealed
(``Namespace.sealed``; see ``hicache_store.layout.sealing`` for what that means on the wire)::

    # hicache-store tenant keys: keep secret (chmod 600)
    active  3f0c...64 hex characters...      seals new objects, and reads
    read    a91b...64 hex characters...      a previous key: still reads its objects
    retired 5d2e47a09c1b33f0                 a key id: no longer read; gc removes its objects

Exactly one ``active`` key; any number of ``read`` keys and ``retired`` key ids (a retired
line may hold the old secret instead of its id: only the id is kept). ``#`` starts a comment.
A text that is one bare 64-hex secret is a ring with that key active.

**Rotation.** ``rotate_text`` makes the active key a ``read`` key and adds a new active one:
new objects are sealed (and named) with the new key, and readers look for a page under the
active key first, then under each ``read`` key, so everything stored before still hits.
Pages found under an old key stay there (writers skip pages that exist) until that key is
retired; then they are misses, recomputed and written under the active key, and
``hicache-store gc --tenant-key-file F --remove-retired`` deletes the retired objects
(headers name their key id; no secret is needed to find them).

**Where a ring comes from** (``load_key_ring``): an explicit file (``tenant_key_file=`` in the
SGLang extra-config, ``--tenant-key-file`` on the CLI), else ``$HICACHE_STORE_TENANT_KEY_FILE``,
else ``$HICACHE_STORE_TENANT_KEY`` holding the ring's text itself (for secret managers that
inject environment variables). Secrets never appear in ``repr``, log lines or error messages:
errors name the source and line, rings print as their key ids.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hicache_store.layout.errors import MissingKeyError
from hicache_store.layout.sealing import KEY_ID_BYTES, SECRET_BYTES, TenantKey

log = logging.getLogger(__name__)

KEY_FILE_ENV = "HICACHE_STORE_TENANT_KEY_FILE"
KEY_TEXT_ENV = "HICACHE_STORE_TENANT_KEY"
#: a key file larger than this is not a key file (refused before parsing).
MAX_KEY_FILE_BYTES = 64 << 10
STATES = ("active", "read", "retired")
_SECRET_RE = re.compile(rf"[0-9a-fA-F]{{{2 * SECRET_BYTES}}}")
_KEY_ID_RE = re.compile(rf"[0-9a-fA-F]{{{2 * KEY_ID_BYTES}}}")
_HEADER = (
    "# hicache-store tenant keys: keep secret (chmod 600). One key per line:\n"
    "#   active <secret>: seals new objects; read <secret>: still reads; retired <key id>\n"
)


@dataclass(frozen=True)
class KeyRing:
    """A tenant's keys. ``readable`` is the active key, then the ``read`` keys, in order:
    the order readers look for a page in. ``retired`` holds key ids only."""

    readable: tuple[TenantKey, ...]
    retired: frozenset[str] = frozenset()
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if not self.readable:
            raise MissingKeyError(f"{self.source}: a key ring needs an active key")
        ids = [k.key_id for k in self.readable]
        if len(set(ids)) != len(ids) or set(ids) & self.retired:
            raise MissingKeyError(f"{self.source}: a key appears twice")

    @property
    def active(self) -> TenantKey:
        """The key that seals and names new objects."""
        return self.readable[0]

    def key(self, key_id: str) -> TenantKey | None:
        """The readable key with this id, or None (retired, or not this tenant's)."""
        for key in self.readable:
            if key.key_id == key_id:
                return key
        return None

    def state(self, key_id: str) -> str | None:
        """``active``, ``read``, ``retired`` or None (a key id this ring does not know)."""
        if key_id == self.active.key_id:
            return "active"
        if self.key(key_id) is not None:
            return "read"
        return "retired" if key_id in self.retired else None

    def __repr__(self) -> str:
        return (
            f"KeyRing(active={self.active.key_id}, "
            f"read={[k.key_id for k in self.readable[1:]]}, retired={sorted(self.retired)}, "
            f"source={self.source!r})"
        )

    __str__ = __repr__


def parse_key_ring(text: str, source: str = "<text>") -> KeyRing:
    """Parse a key ring's text (see the module docstring); ``MissingKeyError`` names the line.

    ``format_key_ring`` is the inverse for rings whose secrets are known.
    """
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    entries = [(n + 1, line.split()) for n, line in enumerate(lines) if line]
    if len(entries) == 1 and len(entries[0][1]) == 1:
        number, (token,) = entries[0]
        if not _SECRET_RE.fullmatch(token):
            raise MissingKeyError(
                f"{source} line {number}: expected '<state> <secret>' or one "
                f"{2 * SECRET_BYTES}-hex-character secret"
            )
        return KeyRing((TenantKey(bytes.fromhex(token)),), source=source)
    active: list[TenantKey] = []
    read: list[TenantKey] = []
    retired: set[str] = set()
    for number, parts in entries:
        where = f"{source} line {number}"
        if len(parts) != 2 or parts[0] not in STATES:
            raise MissingKeyError(
                f"{where}: expected '<state> <value>' with state one of {', '.join(STATES)}"
            )
        state, value = parts
        if state == "retired" and _KEY_ID_RE.fullmatch(value):
            retired.add(value.lower())
            continue
        if not _SECRET_RE.fullmatch(value):
            raise MissingKeyError(
                f"{where}: a {state} key is {2 * SECRET_BYTES} hex characters"
                + (f" (or a {2 * KEY_ID_BYTES}-character key id)" if state == "retired" else "")
            )
        key = TenantKey(bytes.fromhex(value))
        if state == "retired":
            retired.add(key.key_id)
        else:
            (active if state == "active" else read).append(key)
    if len(active) != 1:
        raise MissingKeyError(f"{source}: exactly one active key is needed, found {len(active)}")
    return KeyRing((active[0], *read), frozenset(retired), source)


def format_key_ring(
    active: bytes, read: tuple[bytes, ...] = (), retired: tuple[str, ...] = ()
) -> str:
    """The text of a ring from its secrets (and retired key ids); ``parse_key_ring``'s inverse."""
    lines = [_HEADER, f"active {active.hex()}\n"]
    lines += [f"read {secret.hex()}\n" for secret in read]
    lines += [f"retired {key_id}\n" for key_id in retired]
    return "".join(lines)


def new_ring_text() -> str:
    """The text of a new ring with one random active key."""
    _key, secret = TenantKey.generate()
    return format_key_ring(secret)


def _secrets(text: str, source: str) -> tuple[bytes, list[bytes], list[str]]:
    """(active secret, read secrets, retired ids) of a ring's text, for rewriting it."""
    ring = parse_key_ring(text, source)  # validates everything first
    active = b""
    read: list[bytes] = []
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) == 1:
            active = bytes.fromhex(parts[0])
        elif len(parts) == 2 and parts[0] == "active":
            active = bytes.fromhex(parts[1])
        elif len(parts) == 2 and parts[0] == "read":
            read.append(bytes.fromhex(parts[1]))
    return active, read, sorted(ring.retired)


def rotate_text(text: str, source: str = "<text>") -> str:
    """The ring with a new active key; the old active key becomes the first ``read`` key."""
    active, read, retired = _secrets(text, source)
    _key, secret = TenantKey.generate()
    return format_key_ring(secret, (active, *read), tuple(retired))


def retire_text(text: str, key_id: str, source: str = "<text>") -> str:
    """The ring with ``read`` key ``key_id`` retired (the active key cannot be retired)."""
    active, read, retired = _secrets(text, source)
    if TenantKey(active).key_id == key_id:
        raise MissingKeyError(f"{source}: {key_id} is the active key; rotate first")
    kept = [s for s in read if TenantKey(s).key_id != key_id]
    if len(kept) == len(read):
        raise MissingKeyError(f"{source}: no read key with id {key_id}")
    return format_key_ring(active, tuple(kept), tuple(sorted({*retired, key_id})))


def read_key_file(path: str | os.PathLike[str]) -> KeyRing:
    """Load a ring from a file. Refuses a file over 64 KiB; warns when others can read it."""
    file = Path(path).expanduser()
    try:
        info = file.stat()
        if info.st_size > MAX_KEY_FILE_BYTES:
            raise MissingKeyError(f"tenant key file {file}: {info.st_size} bytes is not a key file")
        text = file.read_text(encoding="ascii")
    except FileNotFoundError:
        raise MissingKeyError(f"tenant key file {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MissingKeyError(f"tenant key file {file}: {type(exc).__name__}") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        log.warning("tenant key file %s is readable by other users (chmod 600 it)", file)
    return parse_key_ring(text, str(file))


def load_key_ring(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> KeyRing | None:
    """The configured ring: ``path``, else ``$HICACHE_STORE_TENANT_KEY_FILE``, else
    ``$HICACHE_STORE_TENANT_KEY`` (the ring's text); None when none is configured."""
    env = os.environ if environ is None else environ
    if path:
        return read_key_file(path)
    if env.get(KEY_FILE_ENV):
        return read_key_file(env[KEY_FILE_ENV])
    if env.get(KEY_TEXT_ENV):
        return parse_key_ring(env[KEY_TEXT_ENV], f"${KEY_TEXT_ENV}")
    return None
