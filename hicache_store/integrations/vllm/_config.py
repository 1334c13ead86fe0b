"""The connector's keys in vLLM's ``kv_connector_extra_config``, and the start-up checks.

Keys (all optional):

``url``                the backend URL (default ``file://$XDG_CACHE_HOME/hicache-store/vllm``,
                       ``~/.cache`` without it): ``file:///var/cache/kv``, ``s3://bucket/p``,
                       ``mooncake://host:port``, ``faulty://?inner=...``, any registered backend.
``backend_options``    a JSON object of options for that backend (``{"capacity_bytes":
                       "64GiB"}``).
``model``              the model identity in the namespace (default: vLLM's ``model``, the
                       served path or hub id, which is also what the SGLang adapter and
                       ``prepopulate`` default to).
``model_revision``     the weights' revision in the namespace; default: the identity of
                       vLLM's model files (``_weights``: the hub snapshot commit, else a
                       fingerprint), so other weights under the same name never hit; ``""``
                       keys none. A connector reset moves it (``_weights``), unless
                       ``keep_revision_on_reset`` is true (default false: only where every
                       reset is known to leave the weights as they were, e.g. sleep/wake).
``grid``               the partition grid ``"LxH"``; ``share_with``: the other topologies that
                       share the store (``["tp=2,pp=1"]``); unset, the coarsest grid this
                       deployment writes (the SGLang adapter's and ``prepopulate``'s rule).
``tenant_salt``        isolates tenants: different salts never hit each other's KV.
``io_timeout_s``       deadline of one backend call of a load or a save (default 20 s); a late
                       load is a failed load, recomputed.
``lookup_timeout_s``   deadline of the scheduler's existence check per request (default 5 s);
                       a late check is a miss.
``retry_after_s``      after a backend failure, seconds during which lookups answer "miss" and
                       saves are dropped without asking the backend (default 5 s): a stopped
                       store costs one deadline, not one per request.
``max_inflight_mib``   bytes of reads in flight per worker (default 256 MiB).
``max_pending_save_mib``  packed pages waiting to be written per worker (default 256 MiB);
                       beyond it new saves are dropped (counted), never waited for.
``l2_mib``             host memory per worker process for the L2 (default 1024 MiB; ``0`` turns
                       it off): pages each worker saved or loaded, of its own shard, kept in
                       host memory and served before the backend is asked, least recently used
                       out first. Memory is taken as pages arrive, up to this bound; a non-zero
                       value below one page of the worker's shard is refused.
``page_size``          tokens of a stored page (default: vLLM's block size): a multiple of the
                       block size (a page of several blocks) or a divisor of it (a block of
                       several pages), for one KV cache group of full-attention MHA; other
                       models keep the block size. Hits are whole blocks (``layout.blocks``).
``allow_cpu_mla``      serve an MLA model on vLLM's CPU platform (default off: refused). vLLM
                       0.32's CPU MLA computes a prefill over a restored context differently
                       from a full prefill (vLLM turns prefix caching off for MLA there), so the
                       tokens then follow vLLM's own offloading's, not a recompute's.
``write_admission``    ``"reuse"`` (default): under capacity pressure, saves are refused while
                       the store evicts the pages this connector saved before their next read,
                       or (a backend that declares ``capacity_usage``) when they would evict
                       pages saved or found lately (``integrations._admission``, the
                       secondary tier's rule); ``"all"``:
                       every save is made (the backend's LRU alone).
``test_alter_loaded_kv``  TEST ONLY: zero every 97th byte of each page after it was verified
                       and before it reaches vLLM (and save nothing), to show that wrong KV
                       does change the tokens.

Unknown keys are refused (a typo must not silently change the namespace), and so is a URL no
backend is registered for. ``check_transfer_config`` makes every check that needs no model, so
that it can run in vLLM's front-end process, before any engine process starts (see
``connector``); the secondary tier's keys (``TIER_KEYS``) are checked alike
(``check_tier_options``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_store.backends import BackendURL, get_backend_class
from hicache_store.backends.errors import UnknownBackendError
from hicache_store.integrations._admission import check_write_admission
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.namespace import Grid
from hicache_store.layout.topology import Topology
from hicache_store.objects.io import DEFAULT_IO_TIMEOUT_S
from hicache_store.sglang_config import parse_grid

#: the vLLM releases this connector is written and tested against (its connector API is marked
#: experimental and changes between minor releases).
SUPPORTED_VLLM = "0.32."

#: the L2's default size per worker process, MiB.
DEFAULT_L2_MIB = 1024

KEYS = frozenset(
    {
        "url",
        "backend_options",
        "model",
        "model_revision",
        "keep_revision_on_reset",
        "grid",
        "share_with",
        "tenant_salt",
        "io_timeout_s",
        "lookup_timeout_s",
        "retry_after_s",
        "max_inflight_mib",
        "max_pending_save_mib",
        "l2_mib",
        "page_size",
        "allow_cpu_mla",
        "write_admission",
        "test_alter_loaded_kv",
    }
)


#: the keys of a ``secondary_tiers`` entry for ``HiCacheStoreTier`` (``type`` and
#: ``module_path`` are vLLM's; see ``secondary_tier``).
TIER_KEYS = frozenset(
    {
        "url",
        "backend_options",
        "model",
        "model_revision",
        "keep_revision_on_reset",
        "tenant_salt",
        "io_timeout_s",
        "lookup_timeout_s",
        "lookup_max_age_s",
        "max_inflight_mib",
        "enable_kv_events",
        "locality",
        "test_alter_loaded_kv",
        "write_admission",
    }
)

#: keys users reach for to bound the store; it is the backend's option, in the URL.
_CAPACITY_WORDS = ("capacity", "size", "max_bytes", "bytes", "limit", "quota")


def default_url() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return "file://" + os.path.join(cache, "hicache-store", "vllm")


def unknown_keys_error(what: str, unknown: list[str], known: frozenset[str]) -> ConfigError:
    """One line naming each unknown key (with its close spelling), the known keys, and where a
    store's capacity goes when a key looks like one."""
    hints = []
    capacity = False
    for key in sorted(unknown):
        if any(word in key.lower() for word in _CAPACITY_WORDS):
            capacity = True
            hints.append(repr(key))
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    message = f"{what}: unknown key(s) " + ", ".join(hints) + f"; known: {', '.join(sorted(known))}"
    if capacity:
        message += ("; a store's capacity is the backend's option, in its URL: "
                    "url='file:///path?capacity_bytes=64GiB' (or backend_options)")
    return ConfigError(message)


def check_backend_url(url: str) -> None:
    """Refuse (``ConfigError``) a URL no backend is registered for, without opening anything."""
    if "://" not in url:
        guess = "file://" + os.path.abspath(os.path.expanduser(url.removeprefix("file:")))
        raise ConfigError(f"url {url!r} is not a backend URL (scheme://location): did you "
                          f"mean {guess!r}?")
    scheme = BackendURL.parse(url).scheme
    try:
        get_backend_class(scheme if "+" not in scheme else scheme.partition("+")[0])
    except UnknownBackendError as exc:
        raise ConfigError(f"url {url!r}: {exc.message}") from exc


def check_tier_options(options: Mapping[str, Any]) -> None:
    """Refuse keys of a ``secondary_tiers`` entry that ``HiCacheStoreTier`` does not take."""
    unknown = sorted(set(options) - TIER_KEYS)
    if unknown:
        raise unknown_keys_error("HiCacheStoreTier (a secondary_tiers entry)", unknown, TIER_KEYS)


@dataclass(frozen=True)
class ConnectorConfig:
    """The parsed ``kv_connector_extra_config`` (see the module docstring)."""

    url: str = field(default_factory=default_url)
    backend_options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    model_revision: str | None = None  # None: derived from the model's files
    keep_revision_on_reset: bool = False
    grid: Grid | None = None
    share_with: tuple[Topology, ...] = ()
    tenant_salt: str = ""
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    lookup_timeout_s: float = 5.0
    retry_after_s: float = 5.0
    max_inflight_bytes: int = 256 << 20
    max_pending_save_bytes: int = 256 << 20
    l2_bytes: int = DEFAULT_L2_MIB << 20
    page_size: int | None = None
    allow_cpu_mla: bool = False
    write_admission: str = "reuse"
    test_alter_loaded_kv: bool = False

    @property
    def backend(self) -> dict[str, Any]:
        return {"url": self.url, **self.backend_options}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KEYS)
        if unknown:
            raise unknown_keys_error("HiCacheStoreConnector: kv_connector_extra_config", unknown,
                                     KEYS)
        options = extra.get("backend_options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError("backend_options: expected a JSON object")
        share = extra.get("share_with") or ()
        if isinstance(share, str):
            share = [share]
        return cls(
            url=str(extra.get("url") or default_url()),
            backend_options=dict(options),
            model=str(extra["model"]) if extra.get("model") else None,
            model_revision=(None if extra.get("model_revision") is None
                            else str(extra["model_revision"])),
            keep_revision_on_reset=_flag(extra, "keep_revision_on_reset"),
            grid=parse_grid(extra["grid"]) if extra.get("grid") is not None else None,
            share_with=tuple(Topology.parse(str(t)) for t in share),
            tenant_salt=str(extra.get("tenant_salt", "")),
            io_timeout_s=_positive(extra, "io_timeout_s", DEFAULT_IO_TIMEOUT_S),
            lookup_timeout_s=_positive(extra, "lookup_timeout_s", 5.0),
            retry_after_s=_positive(extra, "retry_after_s", 5.0, allow_zero=True),
            max_inflight_bytes=int(_positive(extra, "max_inflight_mib", 256) * (1 << 20)),
            max_pending_save_bytes=int(_positive(extra, "max_pending_save_mib", 256) * (1 << 20)),
            l2_bytes=int(_positive(extra, "l2_mib", DEFAULT_L2_MIB, allow_zero=True) * (1 << 20)),
            page_size=int(extra["page_size"]) if extra.get("page_size") is not None else None,
            allow_cpu_mla=bool(extra.get("allow_cpu_mla", False)),
            write_admission=check_write_admission(extra.get("write_admission", "reuse")),
            test_alter_loaded_kv=bool(extra.get("test_alter_loaded_kv", False)),
        )


def _positive(extra: Mapping[str, Any], key: str, default: float, *,
              allow_zero: bool = False) -> float:
    value = extra.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'non-negative' if allow_zero else 'positive'}")
    return number


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value
