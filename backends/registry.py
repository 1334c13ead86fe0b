"""The backend registry: names to classes, and the one way every backend is built.

Three sources, one table:

1. **Built-ins**, registered here as lazy import strings (``"file"`` ->
   ``"hicache_store.backends.file:FileBackend"``): nothing is imported until a backend is
   opened, and a missing optional dependency turns into ``MissingDependencyError`` carrying the
   install hint.
2. **Entry points** in the group ``hicache_store.backends`` (``name = "module:Class"``), read
   once, the first time a name is looked up that is not already known. A plugin may not take a
   built-in's name: it is skipped with a warning.
3. **Explicit** ``register_backend(name, "module:Class" | cls)`` calls. A name is never
   silently overridden: registering a taken name raises ``DuplicateBackendError`` unless
   ``replace=True``.

``backends`` is a read-only view of the table. Any class can also be used without registering
it, by its ``module:Class`` spec.

Building: ``open_backend(url_or_config, **options)`` is the only constructor path, the same
from Python, the CLI and an engine's extra-config JSON::

    open_backend("file:///var/cache/kv?durability=full", capacity_bytes="200GiB")
    open_backend({"url": "s3://bucket/prefix", "region": "us-east-1"})
    open_backend("mypkg.store:MyBackend", endpoint="...")       # a class by spec
    open_backend({"backend": "mypkg.store:MyBackend", "endpoint": "..."})

The URL's scheme names the backend, its query string gives options, keyword options override
the query; then ``cls.from_url(url, options)`` builds it. Every backend is built that way: no
per-name branches anywhere.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hicache_store.layout.errors import ConfigError, HiCacheStoreError

from .base import Backend
from .errors import (
    BackendError,
    DuplicateBackendError,
    MissingDependencyError,
    UnknownBackendError,
)
from .types import BackendURL, unknown_options_error

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hicache_store.backends"
_NAME_RE = re.compile(r"[a-z][a-z0-9_+.-]{0,63}")
_SPEC_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class BackendSpec:
    """One registry entry: where the class lives, how to install what it needs, who added it.

    ``target`` is a ``module:Class`` string (imported on first use) or the class itself.
    ``origin`` is ``builtin``, ``entry-point`` or ``user``.
    """

    name: str
    target: str | type[Backend]
    install_hint: str | None = None
    origin: str = "user"


_lock = threading.RLock()
_registry: dict[str, BackendSpec] = {}
_loaded_groups: set[str] = set()  # entry-point groups already read (read once per process)

#: read-only view of every registered backend (entry points appear once they are loaded).
backends: Mapping[str, BackendSpec] = MappingProxyType(_registry)

_BUILTINS: tuple[tuple[str, str, str | None], ...] = (
    ("memory", "hicache_store.backends.memory:MemoryBackend", None),
    ("file", "hicache_store.backends.file:FileBackend", None),
    ("faulty", "hicache_store.backends.faulty:FaultyBackend", None),
    ("s3", "hicache_store.backends.s3:S3Backend", "pip install boto3 (the s3 extra)"),
    ("fsspec", "hicache_store.backends.fsspec:FsspecBackend",
     "pip install fsspec (the fsspec extra)"),
    ("hf3fs", "hicache_store.backends.hf3fs:HF3FSBackend", "pip install hf3fs-py-usrbio (needs a 3FS cluster)"),
    ("mooncake", "hicache_store.backends.mooncake:MooncakeBackend",
     "pip install mooncake-transfer-engine-non-cuda (the mooncake extra)"),
)


def register_backend(
    name: str,
    target: str | type[Backend],
    *,
    install_hint: str | None = None,
    replace: bool = False,
    origin: str = "user",
) -> None:
    """Register ``name`` for ``target`` (a ``module:Class`` string, imported lazily, or a class).

    ``name`` is lowercase (``[a-z][a-z0-9_+.-]*``): it is a URL scheme. Raises
    ``DuplicateBackendError`` if the name is taken, unless ``replace=True``.
    """
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ValueError(f"backend name {name!r} must match {_NAME_RE.pattern}")
    if isinstance(target, str):
        if _SPEC_RE.fullmatch(target) is None:
            raise ValueError(f"backend target {target!r} must be 'module:Class'")
    elif not (isinstance(target, type) and issubclass(target, Backend)):
        raise TypeError(f"backend target must be 'module:Class' or a Backend subclass, got {target!r}")
    with _lock:
        existing = _registry.get(name)
        if existing is not None and not replace:
            raise DuplicateBackendError(
                f"backend name {name!r} is already registered ({existing.origin}: "
                f"{_describe(existing.target)}); pass replace=True to override it on purpose"
            )
        _registry[name] = BackendSpec(name, target, install_hint, origin)


def unregister_backend(name: str) -> None:
    """Remove a name (for tests and for plugins that re-register)."""
    with _lock:
        _registry.pop(name, None)


def _describe(target: str | type[Backend]) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def load_entry_points() -> None:
    """Read the ``hicache_store.backends`` entry-point group (once per process)."""
    with _lock:
        if ENTRY_POINT_GROUP in _loaded_groups:
            return
        _loaded_groups.add(ENTRY_POINT_GROUP)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                register_backend(ep.name, ep.value, origin="entry-point")
            except (DuplicateBackendError, ValueError, TypeError) as exc:
                dist = getattr(ep.dist, "name", "?")
                log.warning("ignoring backend entry point %r from %s: %s", ep.name, dist, exc)


def available_backends() -> Mapping[str, BackendSpec]:
    """Every backend name, entry points included (a read-only view)."""
    load_entry_points()
    return backends


def _import_target(spec: str, *, name: str, install_hint: str | None) -> type[Backend]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and (missing == module_name or module_name.startswith(missing + ".")):
            what = f"backend {name!r} is not available: module {module_name!r} does not exist"
        else:
            what = f"backend {name!r} needs {missing or 'a module'} that is not installed ({exc})"
        raise MissingDependencyError(what, install_hint=install_hint, backend=name) from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"{spec} is not a hicache_store Backend subclass", backend=name)
    return cls


def get_backend_class(name_or_spec: str) -> type[Backend]:
    """The class for a registered name or a ``module:Class`` spec (importing it if needed).

    Raises ``UnknownBackendError`` (listing the known names) or ``MissingDependencyError``
    (with the install hint).
    """
    with _lock:
        spec = _registry.get(name_or_spec)
    if spec is None and _SPEC_RE.fullmatch(name_or_spec):
        return _import_target(name_or_spec, name=name_or_spec, install_hint=None)
    if spec is None:
        load_entry_points()
        with _lock:
            spec = _registry.get(name_or_spec)
    if spec is None:
        known = sorted(_registry)
        close = difflib.get_close_matches(name_or_spec, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownBackendError(
            f"no backend named {name_or_spec!r}{hint}; known: {', '.join(known)} "
            "(or use 'module:Class')"
        )
    if isinstance(spec.target, type):
        return spec.target
    return _import_target(spec.target, name=spec.name, install_hint=spec.install_hint)


def scheme_backend(scheme: str) -> str:
    """The backend name a URL's scheme selects: the scheme, or for ``fsspec+s3://`` (a backend
    with a sub-protocol, which the backend reads from the URL) the part before the ``+``."""
    with _lock:
        known = scheme in _registry
    if "+" in scheme and not known:
        return scheme.partition("+")[0]
    return scheme


def open_backend(config: str | Mapping[str, Any], /, **options: Any) -> Backend:
    """Build a backend from a URL, a name, a ``module:Class`` spec, or a config mapping.

    - ``"file:///path?durability=full"``: the scheme names the backend, the query gives options.
    - ``"memory"`` / ``"mypkg.mod:MyBackend"``: no location.
    - ``{"url": ..., "backend": ..., **options}``: what an engine's extra-config JSON holds;
      ``backend`` (a name or spec) wins over the URL's scheme, which then only gives the
      location.

    Keyword ``options`` override both. The class's ``from_url(url, options)`` does the rest.

    A wrong URL or option is one ``ConfigError`` line naming it (a misspelled option with its
    close spellings), raised before the backend creates or connects to anything.
    """
    opts: dict[str, Any]
    if isinstance(config, Mapping):
        opts = dict(config)
        url_text = opts.pop("url", None)
        target = opts.pop("backend", None)
        if url_text is None and target is None:
            raise ConfigError("a backend config needs 'url' or 'backend'")
        opts.update(options)
    elif isinstance(config, str):
        url_text, target, opts = config, None, dict(options)
    else:
        raise ConfigError(f"open_backend takes a URL string or a mapping, got {type(config).__name__}")
    if url_text is not None and "://" not in url_text:
        target, url_text = url_text, None  # a bare name or a module:Class spec
    if target is not None and not (_NAME_RE.fullmatch(target) or _SPEC_RE.fullmatch(target)):
        raise ConfigError(_not_a_url(target))
    url = BackendURL.parse(url_text) if url_text is not None else BackendURL(scheme="")
    name = target or scheme_backend(url.scheme)
    cls = get_backend_class(name)
    merged = {**url.query, **opts}
    try:
        return cls.from_url(url, merged)
    except HiCacheStoreError:
        raise  # ConfigError, MissingDependencyError, a store that cannot be opened: as they are
    except ImportError as exc:
        # An SDK imported lazily by the backend's constructor (boto3, s3fs, ...): same
        # one-line error with the install hint as a missing backend module.
        spec = _registry.get(name)
        raise MissingDependencyError(
            f"the {name} backend needs a package that is not installed ({exc})",
            install_hint=spec.install_hint if spec is not None else None,
            backend=name,
        ) from exc
    except TypeError as exc:
        unknown = _unknown_keyword(exc, cls)
        if unknown is None:
            raise
        raise unknown_options_error(f"{name} backend", [unknown], _keywords(cls)) from exc
    except ValueError as exc:
        # A third-party backend's own validation (built-ins raise ConfigError themselves).
        text = " ".join(str(exc).split())
        raise ConfigError(f"bad {name} backend configuration: {text}") from exc


def _not_a_url(text: str) -> str:
    """The error for a string that is neither a URL, a backend name nor a ``module:Class``
    spec: what was probably meant (a path is a ``file://`` URL, ``file:/x`` is
    ``file:///x``)."""
    scheme, colon, rest = text.partition(":")
    if colon and _NAME_RE.fullmatch(scheme.lower()):
        if scheme.lower() == "file":
            guess = "file://" + os.path.abspath(os.path.expanduser(rest))
        else:
            guess = f"{scheme.lower()}://{rest.lstrip('/')}"
    else:
        guess = "file://" + os.path.abspath(os.path.expanduser(text))
    return (f"{text!r} is not a backend URL (scheme://location): did you mean {guess!r}? "
            f"Schemes: {', '.join(sorted(_registry))}")


_UNEXPECTED_KEYWORD = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")


def _unknown_keyword(exc: TypeError, cls: type[Backend]) -> str | None:
    """The option a backend's constructor refused as an unknown keyword, else None (a
    ``TypeError`` from deeper inside is a bug and stays one)."""
    match = _UNEXPECTED_KEYWORD.match(str(exc))
    if match is None or match[1] not in {k.__name__ for k in cls.__mro__}:
        return None
    return match[2]


def _keywords(cls: type[Backend]) -> list[str]:
    """The options a backend's constructor takes by keyword (those with a default: the
    required ones, such as a root or a bucket, come from the URL)."""
    params = inspect.signature(cls.__init__).parameters.values()
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds and p.default is not p.empty]


for _name, _target, _hint in _BUILTINS:
    register_backend(_name, _target, install_hint=_hint, origin="builtin")
