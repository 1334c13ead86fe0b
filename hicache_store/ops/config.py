"""Where a command's settings come from: flags > environment > config file > defaults.

One small module, used the same way by every command::

    def register(subparsers):
        parser = subparsers.add_parser("inspect", ...)
        parser.add_argument("url", nargs="?")
        parser.add_argument("--concurrency", type=int, default=16)
        ...
        layered(parser, section="inspect")      # last: after every add_argument

    def run(args):
        resolve(args)                           # first: fills what no flag gave
        ...

For each option (its argparse ``dest``, e.g. ``batch_size``) the first source that has a value
wins:

1. the command-line flag;
2. ``HICACHE_STORE_<SECTION>_<DEST>`` (e.g. ``HICACHE_STORE_PREPOPULATE_BATCH_SIZE``), then
   ``HICACHE_STORE_<DEST>`` (e.g. ``HICACHE_STORE_URL``, shared by every command);
3. the TOML config file: the key in the command's ``[section]`` table, then at the top level
   (keys may be spelled ``batch-size`` or ``batch_size``);
4. the parser's default.

The config file is ``--config PATH`` (added by ``layered``), else ``$HICACHE_STORE_CONFIG``,
else ``$XDG_CONFIG_HOME/hicache-store/config.toml`` (``~/.config/...``) when it exists. A file
named explicitly must exist. Values from the environment are strings and go through the
option's own ``type`` (a flag takes ``1/true/yes/on`` or ``0/false/no/off``; a list option takes
a comma-separated list); TOML values keep their TOML types (``batch-size = 8``,
``verify = true``). Any bad value, unknown key in the command's table or unreadable file is a
``UsageError`` naming its source (exit code 2). Top-level keys unknown to a command are ignored:
other commands may use them.

Positional arguments can come from the environment or the file too when declared with
``nargs="?"``; a command then checks that the value arrived (``require(args, "url")``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from hicache_store.errors import UsageError

ENV_PREFIX = "HICACHE_STORE_"
CONFIG_ENV = "HICACHE_STORE_CONFIG"
_UNSET: Any = object()
_SKIP_DESTS = frozenset({"help", "config", "func", "version"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class _Layer:
    """What ``layered`` recorded about one parser: its section and each option's action."""

    section: str
    actions: dict[str, argparse.Action] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)


def layered(parser: argparse.ArgumentParser, *, section: str) -> argparse.ArgumentParser:
    """Make every option of ``parser`` resolvable from env and config; add ``--config``.

    Call it after the last ``add_argument``. It replaces each option's default by a sentinel
    (so ``resolve`` can tell "not given" from "given the default value") and remembers the
    real default. Help texts must state defaults in words (``%(default)s`` would show the
    sentinel).
    """
    parser.add_argument(
        "--config", metavar="PATH", default=None,
        help=f"TOML config file (default: ${CONFIG_ENV}, else "
             "$XDG_CONFIG_HOME/hicache-store/config.toml if present)",
    )
    layer = _Layer(section)
    for action in parser._actions:
        dest = action.dest
        if dest in _SKIP_DESTS or dest == argparse.SUPPRESS or action.default is argparse.SUPPRESS:
            continue
        layer.actions[dest] = action
        layer.defaults[dest] = action.default
        if action.required and not action.option_strings:
            continue  # a required positional always comes from the command line
        # argparse appends to an append-action's default in place: None (a fresh list per
        # parse) is its "not given"; every other action gets the sentinel.
        action.default = None if isinstance(action, argparse._AppendAction) else _UNSET
    parser.set_defaults(_config_layer=layer)
    return parser


def env_names(section: str, dest: str) -> tuple[str, str]:
    """The two environment variables for an option, most specific first."""
    name = dest.upper().replace("-", "_")
    return f"{ENV_PREFIX}{section.upper()}_{name}", f"{ENV_PREFIX}{name}"


def config_path(explicit: str | None, environ: Mapping[str, str]) -> tuple[Path | None, str]:
    """The config file to read and how it was chosen (``None`` when there is none)."""
    if explicit:
        return Path(explicit).expanduser(), "--config"
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV]).expanduser(), CONFIG_ENV
    base = environ.get("XDG_CONFIG_HOME") or str(Path("~/.config").expanduser())
    default = Path(base) / "hicache-store" / "config.toml"
    return (default, "default") if default.is_file() else (None, "none")


def load_config(path: Path) -> dict[str, Any]:
    """Parse a TOML file; any problem is a ``UsageError`` naming the file."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"config file {path}: {exc}") from None


def _normalize(table: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in table.items()}


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    """Turn a value from the environment (str) or TOML (typed) into what the flag would give."""
    try:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"expected true or false, got {value!r}")
        if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
            items = value if isinstance(value, list) else [
                part.strip() for part in str(value).split(",") if part.strip()
            ]
            return [_convert_one(action, item) for item in items]
        return _convert_one(action, value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"{source}: {exc}") from None


def _convert_one(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (dict, list)):
        raise ValueError(f"expected a single value, got {value!r}")
    converter = action.type
    if (callable(converter) and isinstance(value, str)) or (callable(converter) and converter in (int, float) and not isinstance(value, bool)):
        value = converter(value)
    elif callable(converter) and not isinstance(value, str):
        value = converter(str(value))
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{value!r} is not one of {choices}")
    return value


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Fill every option the command line did not give, in precedence order.

    Returns where each option's value came from (``flag``, the environment variable's name,
    ``<file> [section]``, ``<file>`` or ``default``): commands can show it with ``--debug``,
    and tests assert it.
    """
    layer: _Layer | None = getattr(args, "_config_layer", None)
    if layer is None:
        return {}
    env = os.environ if environ is None else environ
    path, _how = config_path(getattr(args, "config", None), env)
    data = load_config(path) if path is not None else {}
    section_table = data.get(layer.section, {})
    if not isinstance(section_table, dict):
        raise UsageError(f"config file {path}: [{layer.section}] must be a table")
    section_values = _normalize(section_table)
    top_values = _normalize({k: v for k, v in data.items() if not isinstance(v, dict)})
    unknown = sorted(set(section_values) - set(layer.actions))
    if unknown:
        raise UsageError(
            f"config file {path}: unknown key(s) {', '.join(unknown)} in [{layer.section}]"
        )
    sources: dict[str, str] = {}
    for dest, action in layer.actions.items():
        current = getattr(args, dest, _UNSET)
        if isinstance(action, argparse._AppendAction) and current is None:
            current = _UNSET
        if current is not _UNSET:
            sources[dest] = "flag"
            continue
        value: Any = _UNSET
        for name in env_names(layer.section, dest):
            if name in env:
                value, sources[dest] = _convert(action, env[name], name), name
                break
        if value is _UNSET and dest in section_values:
            where = f"{path} [{layer.section}] {dest}"
            value, sources[dest] = _convert(action, section_values[dest], where), where
        if value is _UNSET and dest in top_values:
            where = f"{path} {dest}"
            value, sources[dest] = _convert(action, top_values[dest], where), where
        if value is _UNSET:
            default = layer.defaults[dest]
            value = list(default) if isinstance(default, list) else default
            sources[dest] = "default"
        setattr(args, dest, value)
    return sources


def require(args: argparse.Namespace, dest: str, what: str) -> Any:
    """The value of an option that may come from any layer but must come from one."""
    value = getattr(args, dest, None)
    if value is None or value is _UNSET:
        section = getattr(args, "_config_layer", _Layer("")).section
        env_specific, env_global = env_names(section, dest)
        raise UsageError(f"{what} is required (argument, {env_global}, {env_specific} "
                         f"or '{dest}' in the config file)")
    return value
