"""Configuration of the Mooncake Store backend: one frozen dataclass, four sources.

Where a setting comes from, highest precedence first:

1. **URL and keyword options** (``open_backend("mooncake://127.0.0.1:50051?protocol=tcp&
   segment=0&buffer=16MiB", ...)``). Short names (``protocol``, ``metadata``, ``segment``,
   ``buffer``, ``device``, ``hostname``, ``tenant``) and the long names SGLang's
   ``--hicache-storage-backend-extra-config`` JSON uses (``master_server_address``,
   ``metadata_server``, ``global_segment_size``, ``local_buffer_size``, ``device_name``,
   ``local_hostname``, ``tenant_id``) are both accepted, so an SGLang extra-config dict can be
   passed as it is.
2. **A JSON config file**: the ``config_path`` option, else ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``
   (SGLang), else ``MOONCAKE_CONFIG_PATH`` (Mooncake's own tools). Same long key names.
3. **Environment variables** SGLang and Mooncake users already export: ``MOONCAKE_MASTER``,
   ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
   ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``,
   ``MOONCAKE_LOCAL_HOSTNAME`` (legacy ``LOCAL_HOSTNAME``), ``MOONCAKE_TENANT_ID``.
4. **Defaults**: P2PHANDSHAKE metadata, TCP, a pure client (global segment 0: this process
   lends no memory to the pool; a separate ``mooncake_client``/store service holds it), a
   16 MiB local buffer, hostname ``127.0.0.1``.

Sizes accept ints or strings (``"512MiB"``, ``"4 GB"``, ``"4gb"``: see ``parse_mooncake_size``).
Our own tuning options (``bounce``, ``threads``, ``timeout``) have no Mooncake equivalent.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_store.layout.errors import ConfigError

from .types import convert_options, parse_size, unknown_options_error

#: key of this dataclass's field -> the names accepted for it in options and JSON files.
_ALIASES: dict[str, tuple[str, ...]] = {
    "master": ("master", "master_server_address", "master_server_addr"),
    "metadata": ("metadata", "metadata_server"),
    "protocol": ("protocol",),
    "device": ("device", "device_name", "rdma_devices"),
    "segment": ("segment", "global_segment_size"),
    "buffer": ("buffer", "local_buffer_size"),
    "hostname": ("hostname", "local_hostname"),
    "tenant": ("tenant", "tenant_id"),
}
_ENV: dict[str, tuple[str, ...]] = {
    "master": ("MOONCAKE_MASTER",),
    "metadata": ("MOONCAKE_TE_META_DATA_SERVER",),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "device": ("MOONCAKE_DEVICE",),
    "segment": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "buffer": ("MOONCAKE_LOCAL_BUFFER_SIZE",),
    "hostname": ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"),
    "tenant": ("MOONCAKE_TENANT_ID",),
}
#: the transports Mooncake 0.3's transfer engine knows (its ``protocol`` names): anything else
#: would only fail inside Mooncake's setup, with a log line and a bare error code.
PROTOCOLS = ("tcp", "rdma", "efa", "nvlink", "nvlink_intra", "nvmeof", "cxl", "hip", "ascend", "barex")
_CONFIG_PATH_ENV = ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")
#: our own options (not Mooncake settings) and option keys SGLang passes that we ignore.
_OWN = ("bounce", "threads", "timeout", "config_path")
_IGNORED = (
    "master_metrics_port", "check_server", "standalone_storage", "client_server_address",
    "enable_ssd_offload", "ssd_offload_path", "backend_name", "module_path", "class_name",
    "interface_v1",
)


def parse_mooncake_size(value: Any) -> int:
    """Bytes from an int or a size string, in both our spelling (``512MiB``, ``2GB``) and
    Mooncake's (``"4 GB"``, ``"4gb"``, which Mooncake reads as GiB; we follow it so that a value
    copied from a Mooncake config means the same here)."""
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        low = text.lower()
        if low.endswith(("kb", "mb", "gb", "tb")) and not low.endswith(("ib",)):
            text = text[:-2] + text[-2].upper() + "iB"
        return parse_size(text)
    return parse_size(value)


#: seconds a Mooncake call may take by default before ``BackendTimeoutError``
#: (docs/guide/backends/deadlines.md has every backend's bounds in one table).
DEFAULT_TIMEOUT = 15.0


@dataclass(frozen=True)
class MooncakeConfig:
    """Everything needed to set up one ``MooncakeDistributedStore`` client, plus our tuning.

    - ``master``: the master's RPC address ``host:port``.
    - ``metadata``: the transfer engine's metadata service (``P2PHANDSHAKE``: no metadata
      server; peers exchange segment descriptors directly).
    - ``protocol``: ``tcp`` or ``rdma`` (RDMA needs ``device``).
    - ``segment``: bytes of this process's memory lent to the pool (0: pure client).
    - ``buffer``: Mooncake's own local transfer buffer (used by its byte-object API only).
    - ``hostname``: the address this client advertises to peers. It must be reachable by the
      segment holders; on one machine keep ``127.0.0.1``.
    - ``bounce``: bytes of registered staging memory for callers' buffers that are not
      registered (see ``MooncakeBackend``).
    - ``threads``: worker threads running blocking Mooncake calls (the per-process bound).
    - ``timeout``: seconds a call may take before ``BackendTimeoutError`` (0: no deadline;
      default 15). Mooncake's own RPC and transfer timeouts are set below it at setup (see
      ``_mooncake_client.MOONCAKE_TIMEOUT_ENV``), so that a call which cannot be given up
      (zero-copy into registered memory) still ends within about ``timeout``.
    """

    master: str
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    segment: int = 0
    buffer: int = 16 << 20
    hostname: str = "127.0.0.1"
    tenant: str = "default"
    bounce: int = 64 << 20
    threads: int = 4
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        host, sep, port = self.master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"mooncake master address must be host:port, got {self.master!r}")
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.timeout < 0:
            raise ConfigError(f"timeout must be >= 0, got {self.timeout}")
        if self.protocol != self.protocol.lower():
            object.__setattr__(self, "protocol", self.protocol.lower())
        if self.protocol not in PROTOCOLS:
            close = difflib.get_close_matches(self.protocol, PROTOCOLS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown mooncake protocol {self.protocol!r}{hint}; known: {', '.join(PROTOCOLS)}"
            )

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master.rpartition(":")
        return host.strip("[]"), int(port)

    def client_key(self) -> tuple[Any, ...]:
        """What identifies one shared client: two backends with equal keys share a client."""
        return (self.master, self.metadata, self.protocol, self.device, self.segment,
                self.buffer, self.hostname, self.tenant, self.bounce, self.threads)

    @classmethod
    def resolve(
        cls,
        location: str,
        options: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
    ) -> MooncakeConfig:
        """Merge URL location + options, a JSON config file and the environment (see module).

        ``location`` is the URL's ``host:port`` (may be empty: then the master comes from the
        options, the JSON file or ``MOONCAKE_MASTER``). Unknown option names raise
        ``ConfigError`` naming them (with close spellings), so a typo is loud.
        """
        env = os.environ if environ is None else environ
        opts = convert_options(options, ints=("threads",), floats=("timeout",), sizes=("bounce",))
        known = [*_OWN, *(name for names in _ALIASES.values() for name in names)]
        unknown = [k for k in opts if k not in known and k not in _IGNORED]
        if unknown:
            raise unknown_options_error("mooncake", unknown, known)
        file_values: dict[str, Any] = {}
        path = opts.get("config_path") or next((env[v] for v in _CONFIG_PATH_ENV if env.get(v)), "")
        if path:
            with open(path, encoding="utf-8") as fh:
                loaded = json.load(fh)
            if not isinstance(loaded, dict):
                raise ConfigError(f"mooncake config file {path} must hold a JSON object")
            file_values = loaded

        def pick(field: str) -> Any:
            for source in (opts, file_values):
                for name in _ALIASES[field]:
                    if source.get(name) not in (None, ""):
                        return source[name]
            for name in _ENV[field]:
                if env.get(name):
                    return env[name]
            return None

        values: dict[str, Any] = {}
        master = location or pick("master")
        if not master:
            raise ConfigError(
                "no mooncake master address: give mooncake://host:port, the "
                "master_server_address option, a JSON config file, or MOONCAKE_MASTER"
            )
        values["master"] = str(master)
        for field in ("metadata", "protocol", "device", "hostname", "tenant"):
            value = pick(field)
            if value is not None:
                values[field] = str(value)
        for field in ("segment", "buffer"):
            value = pick(field)
            if value is not None:
                values[field] = parse_mooncake_size(value)
        values.update({k: opts[k] for k in ("bounce", "threads", "timeout") if opts.get(k) is not None})
        return cls(**values)
