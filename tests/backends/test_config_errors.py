"""Configuration errors (issue 17): every bad backend URL or option is one ``ConfigError``.

A ``ConfigError`` is a ``HiCacheStoreError`` (and a ``ValueError``): one readable line that
names the option and the value, raised before anything is created on disk or connected.
Before it existed these were plain ``ValueError`` / ``TypeError`` ("could not convert string
to float: 'x'", "FileBackend.__init__() got an unexpected keyword argument ...").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_store.backends import open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.errors import ConfigError, HiCacheStoreError

# (URL with {root} for a fresh directory, words the one-line message must contain)
CASES: list[tuple[str, tuple[str, ...]]] = [
    ("file://tmp/x", ("host part",)),
    ("file://{root}/a?durabilty=full", ("durabilty", "did you mean 'durability'")),
    ("file://{root}/a?durability=bogus", ("durability", "bogus")),
    ("file://{root}/a?capacity_bytes=-1", ("capacity_bytes", "-1")),
    ("file://{root}/a?capacity_bytes=lots", ("capacity_bytes", "lots")),
    ("file://{root}/a?io_threads=x", ("io_threads", "'x'")),
    ("file://{root}/a?io_threads=0", ("io_threads", "0")),
    ("file://{root}/a?create=maybe", ("create", "maybe")),
    ("file://{root}/a?lock_timeout=soon", ("lock_timeout", "soon")),
    ("file://{root}/a?page_cache=sometimes", ("page_cache", "sometimes")),
    ("file://{root}/a?index=btree", ("index", "btree")),
    ("file://{root}/a?direct_io=maybe", ("direct_io", "maybe")),
    ("memory://somewhere", ("memory", "somewhere")),
    ("memory://?capacity_bytes=-5", ("capacity_bytes", "-5")),
    ("memory://?capacty_bytes=5", ("capacty_bytes", "did you mean 'capacity_bytes'")),
    ("faulty://", ("inner",)),
    ("faulty://?inner=file://{root}/a&error_rate=2", ("error_rate", "2")),
    ("faulty://?inner=file://{root}/a&eror_rate=0.1", ("eror_rate", "did you mean 'error_rate'")),
    ("faulty://?inner=memory://&error_rate=often", ("error_rate", "often")),
    ("faulty://?inner=memory://&seed=x", ("seed", "'x'")),
    ("s3://", ("bucket",)),
    ("s3://bucket?request_timeout=x", ("request_timeout", "'x'")),
    ("s3://bucket?max_attempts=0", ("max_attempts", "0")),
    ("s3://bucket?max_concurency=3", ("max_concurency", "did you mean 'max_concurrency'")),
    ("s3://bucket?multipart_threshold=-1", ("multipart_threshold", "-1")),
    ("s3://bucket?conditional_put=perhaps", ("conditional_put", "perhaps")),
    ("fsspec://", ("fsspec+<protocol>",)),
    ("fsspec+memory://root?request_timeout=x", ("request_timeout", "'x'")),
    ("fsspec+memory://root?max_concurrency=0", ("max_concurrency", "0")),
    ("mooncake://127.0.0.1:1?timeout=x", ("timeout", "'x'")),
    ("mooncake://127.0.0.1:1?protocl=tcp", ("protocl", "did you mean 'protocol'")),
    ("mooncake://127.0.0.1:1?threads=0", ("threads", "0")),
    ("hf3fs://rel", ("host part",)),
    ("hf3fs://{root}/a?usrbio_timeout=x", ("usrbio_timeout", "'x'")),
    ("hf3fs://{root}/a?ring_entries=0", ("ring_entries", "0")),
    ("hf3fs://{root}/a?engine=fast", ("engine", "fast")),
    ("://x", ("no scheme",)),
]


@pytest.mark.parametrize(("url", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_url_is_one_config_error_and_creates_nothing(
    tmp_path: Path, url: str, words: tuple[str, ...]
) -> None:
    root = tmp_path / "store"
    with pytest.raises(ConfigError) as info:
        open_backend(url.format(root=root))
    error = info.value
    assert isinstance(error, HiCacheStoreError) and isinstance(error, ValueError)
    text = str(error)
    assert "\n" not in text, text
    for word in words:
        assert word in text, (word, text)
    assert not root.exists(), "a store was created before its configuration was refused"


def test_a_config_mapping_without_url_or_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'url' or 'backend'"):
        open_backend({"durability": "full"})


@pytest.mark.parametrize(
    "options",
    [{"capacity_bytes": -1}, {"capacity_bytes": "lots"}, {"io_threads": 0}, {"lock_timeout": 0}],
)
def test_the_file_backend_validates_every_option_before_creating_its_root(
    tmp_path: Path, options: dict[str, object]
) -> None:
    root = tmp_path / "store"
    with pytest.raises(ConfigError):
        FileBackend(root, **options)  # type: ignore[arg-type]
    assert not root.exists(), "directories were created before the options were refused"


def test_the_cli_reports_a_bad_url_in_one_line_with_the_usage_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hicache_store.cli import EXIT_USAGE, main

    root = tmp_path / "store"
    assert main(["inspect", f"file://{root}?durabilty=full"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'durability'" in err, err
    assert "Traceback" not in err
    assert not root.exists()
