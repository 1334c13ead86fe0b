"""``hicache-store bench``: measurement commands, one sub-subcommand per module.

Each module in ``BENCH_MODULES`` exposes ``register(subparsers)`` like a top-level command
module (``hicache_store.cli.COMMAND_MODULES``); adding a benchmark is adding its module name here.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from hicache_store.commands._common import add_command

#: bench subcommand modules, in the order ``bench --help`` lists them.
BENCH_MODULES: tuple[str, ...] = (
    "hicache_store.commands.bench_backend",
    "hicache_store.commands.bench_multiturn",
    "hicache_store.commands.bench_pd",
    "hicache_store.commands.bench_trace",
)


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "bench", doc=__doc__,
                         help="measure throughput (backends, ...)")
    inner = parser.add_subparsers(
        dest="bench_command", metavar="BENCHMARK", parser_class=type(parser)
    )
    inner.required = True
    for module_name in BENCH_MODULES:
        importlib.import_module(module_name).register(inner)
    parser.set_defaults(func=_missing)


def _missing(args: argparse.Namespace) -> int:  # pragma: no cover - argparse requires one
    raise SystemExit(2)
