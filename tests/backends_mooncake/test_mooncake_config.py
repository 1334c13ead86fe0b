"""Configuration of the mooncake backend from URLs, options, SGLang JSON and MOONCAKE_* env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_store.backends import open_backend
from hicache_store.backends._mooncake_client import code_error
from hicache_store.backends._mooncake_config import MooncakeConfig, parse_mooncake_size
from hicache_store.backends.errors import BackendIOError, BackendUnavailableError
from hicache_store.backends.mooncake import MooncakeBackend


def test_url_and_short_options() -> None:
    store = open_backend(
        "mooncake://127.0.0.1:50051?protocol=tcp&metadata=P2PHANDSHAKE&segment=512MiB&buffer=32MiB",
        threads=3,
    )
    assert isinstance(store, MooncakeBackend)
    cfg = store.config
    assert (cfg.master, cfg.protocol, cfg.metadata) == ("127.0.0.1:50051", "tcp", "P2PHANDSHAKE")
    assert (cfg.segment, cfg.buffer, cfg.threads) == (512 << 20, 32 << 20, 3)
    assert store.capabilities.ranged_reads and not store.capabilities.atomic_put


def test_sglang_extra_config_names_are_accepted() -> None:
    extra = {"master_server_address": "10.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
             "global_segment_size": "4gb", "local_buffer_size": 0, "protocol": "RDMA",
             "device_name": "mlx5_0", "local_hostname": "10.0.0.2", "tenant_id": "t1",
             "check_server": False, "interface_v1": 1}
    store = open_backend({"backend": "mooncake", **extra})
    assert isinstance(store, MooncakeBackend)
    cfg = store.config
    assert cfg.master == "10.0.0.1:50051" and cfg.segment == 4 << 30 and cfg.buffer == 0
    assert (cfg.protocol, cfg.device, cfg.hostname, cfg.tenant) == ("rdma", "mlx5_0", "10.0.0.2", "t1")


def test_environment_variables() -> None:
    env = {"MOONCAKE_MASTER": "127.0.0.1:7000", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4294967296", "MOONCAKE_PROTOCOL": "tcp",
           "MOONCAKE_LOCAL_BUFFER_SIZE": "134217728", "LOCAL_HOSTNAME": "127.0.0.2"}
    cfg = MooncakeConfig.resolve("", {}, env)
    assert (cfg.master, cfg.segment, cfg.buffer, cfg.hostname) == (
        "127.0.0.1:7000", 4 << 30, 128 << 20, "127.0.0.2")


def test_options_win_over_json_file_over_env(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:1", "protocol": "tcp",
                                "global_segment_size": "1 GB"}))
    env = {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER": "127.0.0.1:2",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "5"}
    cfg = MooncakeConfig.resolve("", {}, env)
    assert (cfg.master, cfg.segment) == ("127.0.0.1:1", 1 << 30)
    cfg = MooncakeConfig.resolve("127.0.0.1:3", {"segment": 0}, env)
    assert (cfg.master, cfg.segment) == ("127.0.0.1:3", 0)


def test_missing_master_and_unknown_options_are_loud() -> None:
    with pytest.raises(ValueError, match="no mooncake master"):
        MooncakeConfig.resolve("", {}, {})
    with pytest.raises(ValueError, match="unknown mooncake option"):
        MooncakeConfig.resolve("127.0.0.1:1", {"segmnet": 1}, {})
    with pytest.raises(ValueError, match="host:port"):
        MooncakeConfig.resolve("nohost", {}, {})
    with pytest.raises(ValueError, match="unknown mooncake protocol 'rmda' \\(did you mean 'rdma'"):
        MooncakeConfig.resolve("127.0.0.1:1", {"protocol": "RMDA"}, {})
    with pytest.raises(ValueError, match="unknown mooncake protocol 'bogus'; known: tcp, rdma"):
        MooncakeConfig.resolve("127.0.0.1:1", {}, {"MOONCAKE_PROTOCOL": "bogus"})


@pytest.mark.parametrize(("text", "size"), [("4 GB", 4 << 30), ("512MiB", 512 << 20),
                                            ("2gb", 2 << 30), (1024, 1024), ("16MB", 16 << 20)])
def test_sizes_follow_mooncake_spelling(text: object, size: int) -> None:
    assert parse_mooncake_size(text) == size


@pytest.mark.parametrize("code", [-706, -707, -800, -900, -200])
def test_transient_codes_are_retryable(code: int) -> None:
    err = code_error(code, operation="put")
    assert isinstance(err, BackendUnavailableError) and err.retryable


def test_other_codes_are_not_retryable() -> None:
    err = code_error(-1, operation="get_into")
    assert isinstance(err, BackendIOError) and not err.retryable
