"""``hicache-store serve-query URL --namespace DIGEST``: the store's prefix query over HTTP.

Serves ``POST /query`` (tokens or block hashes in; the longest stored prefix per medium out)
and ``GET /layout`` (page size, namespace digest, hash algorithm, key scheme) for one
namespace of the store, until interrupted (``hicache_store.query``)::

    hicache-store serve-query file:///var/cache/kv --namespace 3f2a... --port 8470

The first line on stdout names the address served (``--port 0`` picks a free port). It binds
127.0.0.1 unless ``--host`` says otherwise: whoever reaches the port learns whether a prompt is
stored, so expose it only to the routers that should. Sealed namespaces need their
``--tenant-key-file``; their answers carry counts only.
"""

from __future__ import annotations

import argparse
from typing import Any

from hicache_store.commands._common import add_store_command, add_tenant_key_argument
from hicache_store.errors import UsageError
from hicache_store.ops.config import layered, require, resolve


def register(subparsers: Any) -> None:
    parser = add_store_command(
        subparsers, "serve-query",
        help="serve the store's longest-prefix query over HTTP for routers", doc=__doc__)
    parser.add_argument("--namespace", metavar="DIGEST", required=True,
                        help="the namespace answered for (see `hicache-store inspect`)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8470, help="port (default: 8470; 0: any free)")
    parser.add_argument("--io-timeout", type=float, default=10.0,
                        help="seconds one query may wait on the store (default: 10)")
    add_tenant_key_argument(parser, "the tenant key ring of a sealed namespace")
    layered(parser, section="serve-query")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolve(args)
    url = require(args, "url", "a backend URL")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if not args.io_timeout > 0:
        raise UsageError(f"--io-timeout must be positive, got {args.io_timeout}")
    from hicache_store import sync
    from hicache_store.ops.store import open_store
    from hicache_store.query import QueryServer
    from hicache_store.reader import KVReader
    from hicache_store.tenant import load_key_ring

    try:
        keys = load_key_ring(getattr(args, "tenant_key_file", None))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    backend = open_store(url, existing=True)
    reader = KVReader(backend, args.namespace, io_timeout_s=args.io_timeout, keys=keys)
    try:
        server = QueryServer(reader, args.host, args.port)
    except LookupError as exc:  # no manifest of that namespace in this store
        sync.close(backend)
        raise UsageError(str(exc)) from None
    except OSError as exc:  # the address is taken or cannot be bound
        sync.close(backend)
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    print(f"serving {server.url} (namespace {server.namespace.digest})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        sync.close(backend)
    return 0
