"""The ``hicache-store`` command line: a thin layer over the public API.

Each subcommand lives in ``hicache_store.commands.<name>`` and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (a callable taking the
parsed namespace and returning an exit code); what they share is ``commands/_common.py``, and no
command imports this module. Exit codes: 0 success, 1 failed, 2 bad usage,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Errors print as one readable line;
``--debug`` shows the traceback. An interrupt or SIGTERM cancels the command's work and waits
(bounded) for what is in flight to end and for its store to close (``_sync.run_sync``), then
prints one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from hicache_store import __version__
from hicache_store.commands._common import INSTALL_HINTS
from hicache_store.errors import ConfigError, UsageError

#: subcommand modules, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "hicache_store.commands.plan",
    "hicache_store.commands.bench",
    "hicache_store.commands.gc",
    "hicache_store.commands.prepopulate",
    "hicache_store.commands.inspect",
    "hicache_store.commands.doctor",
    "hicache_store.commands.tenant_key",
    "hicache_store.commands.serve_query",
    "hicache_store.commands.events",
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
#: the shell's code for a process ended by a signal: 128 + the signal's number.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED", "EXIT_USAGE",
           "UsageError", "main"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: it takes Ctrl-C's path (work cancelled, writes in
    flight waited for, the store closed)."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While a command runs in the main thread, SIGTERM raises ``Terminated``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Every parser's description and epilog are plain text (commands pass docstrings).
        for key in ("description", "epilog"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = kwargs[key].replace("``", "")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, exit 2, like argparse, but without the usage block.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache-store", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _sigterm_interrupts():
            code = args.func(args)
    except (UsageError, ConfigError) as exc:  # a bad argument, URL or option: one line
        print(f"hicache-store {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        what = "terminated" if isinstance(exc, Terminated) else "interrupted"
        print(f"hicache-store {args.command}: {what}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly; point stdout at /dev/null so that
        # the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except ModuleNotFoundError as exc:
        if args.debug or exc.name not in INSTALL_HINTS:
            raise
        print(f"hicache-store {args.command}: needs {exc.name}: {INSTALL_HINTS[exc.name]}",
              file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        if args.debug:
            raise
        print(f"hicache-store {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
