"""What the subcommand modules share: argument groups that read the same in every command, the
one ``--json`` writer, and the check for an optional package a command needs.

A command module (``hicache_store.commands.<name>``) imports these; the dispatcher
(``hicache_store.cli``) imports the command modules and ``INSTALL_HINTS``. Nothing here imports
the dispatcher.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hicache_store.errors import UsageError
from hicache_store.tenant import KEY_FILE_ENV, KEY_TEXT_ENV

__all__ = ["INSTALL_HINTS", "add_command", "add_json_output", "add_prompts_argument",
           "add_report_arguments", "add_store_command", "add_tenant_key_argument", "doc_summary",
           "json_on_stdout", "require_module", "write_json"]


#: optional packages commands import, and how to install each (one line instead of a traceback).
#: They name the packages, not ``hicache-store[extra]``: the package is on no index, so an
#: extra installs only from a checkout or a wheel (docs/getting-started/install.md).
INSTALL_HINTS = {
    "torch": "pip install torch==2.13.0 (the CPU wheel; install it before hicache-store's extras)",
    "matplotlib": "pip install matplotlib (the bench extra)",
    "transformers": "pip install transformers tokenizers (the hf extra)",
    "tokenizers": "pip install transformers tokenizers (the hf extra)",
    "zmq": "pip install pyzmq (the events extra)",
}


def require_module(name: str, what: str) -> None:
    """Raise ``UsageError`` now, before any work, if ``name`` cannot be imported."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(f"{what} needs {name}: {INSTALL_HINTS.get(name, f'pip install {name}')}")


def doc_summary(doc: str | None) -> str | None:
    """The first paragraph of a module docstring as help text: reST's ````literal```` marks
    removed (help is read as plain text)."""
    return None if not doc else doc.split("\n\n")[0].replace("``", "")


def add_command(
    subparsers: Any, name: str, *, help: str, doc: str | None
) -> argparse.ArgumentParser:
    """Add subcommand ``name``: ``help`` in its parent's list, described by ``doc``'s first
    paragraph (``doc_summary``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help, description=doc_summary(doc))
    return parser


def add_store_command(
    subparsers: Any, name: str, *, help: str, doc: str | None
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` of a command that opens one store: described by ``doc``'s first
    paragraph, its first argument the store's URL (optional on the command line: the
    ``HICACHE_STORE_URL`` layer of ``ops.config`` gives it)."""
    parser = add_command(subparsers, name, help=help, doc=doc)
    parser.add_argument("url", nargs="?", default=None,
                        help="backend URL, e.g. file:///var/cache/kv (or HICACHE_STORE_URL)")
    return parser


def add_prompts_argument(group: argparse._ActionsContainer) -> None:
    """``--prompts FILE`` (repeatable; ``ops.sources.load_prompts`` reads them)."""
    group.add_argument("--prompts", action="append", default=[], metavar="FILE",
                       help="JSONL (text / messages / input_ids per line) or text file; repeatable")


def add_report_arguments(parser: argparse._ActionsContainer, report: str) -> None:
    """``--json`` (print ``report`` as JSON) and ``--no-progress`` (nothing on stderr)."""
    parser.add_argument("--json", action="store_true", help=f"print the {report} as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")


def add_tenant_key_argument(
    parser: argparse._ActionsContainer, use: str, *, deployment: bool = False
) -> None:
    """``--tenant-key-file PATH``: ``use`` says what the command does with the ring; the default
    named is where ``tenant.load_key_ring`` finds one (with ``deployment``, where
    ``ops.deployment.deployment_keys`` does: the extra-config first)."""
    default = f"${KEY_FILE_ENV} or ${KEY_TEXT_ENV}"
    if deployment:
        default = f"the extra-config's tenant_key_file, else {default}"
    parser.add_argument("--tenant-key-file", metavar="PATH", help=f"{use} (default: {default})")


def add_json_output(parser: argparse._ActionsContainer, what: str) -> None:
    """``--json PATH`` of a command that prints a table and writes files (the benchmarks):
    ``-`` is stdout (the table then goes to stderr), as everywhere: no command writes a file
    named ``-``. Commands that only report take a bare ``--json`` (``add_report_arguments``),
    which prints on stdout too."""
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help=f"write the {what} as JSON to PATH (- for stdout; the table then "
                        "goes to stderr)")


def json_on_stdout(args: argparse.Namespace) -> bool:
    """Whether ``--json -`` asked for the JSON on stdout (tables then go to stderr)."""
    return args.json is not None and str(args.json) == "-"


def write_json(path: Path, document: Any) -> None:
    """``document`` as indented JSON to ``path`` (``-``: stdout). A file is replaced whole
    (written beside it, then renamed): a reader never sees half a document, and a run that
    rewrites it as rows finish never leaves it cut."""
    text = json.dumps(document, indent=2)
    if str(path) == "-":
        print(text, flush=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)
