"""``hicache-store events URL --pub ADDR``: publish what happens to a shared store.

Every writer's puts, every process's capacity evictions, gc and operator deletes, as KV events
in vLLM's wire format with medium ``STORAGE`` (``hicache_store.events.store``), until
interrupted::

    hicache-store events file:///var/cache/kv --namespace 3f2a... \\
        --pub tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --topic kv

This process is a server: it binds ``--pub`` and ``--replay`` whatever their form (routers
connect to it). The first line on stdout names both addresses (port 0 picks a free one). The
first batch (sequence number 0, at every start) is ``AllBlocksCleared`` then the whole store,
so a subscriber that kept its view across a restart of this command drops what went while it
was down (a sequence number lower than the last one seen: replay from 0); then each look at
the store's change feed (every ``--interval`` seconds) is one batch. SIGINT or SIGTERM stops
it cleanly. Needs a store with a change feed (``capabilities.change_feed``: a file root's
shared index, not ``index=none``; any store indexed by Valkey) and the ``events`` extra
(pyzmq).
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from hicache_store.commands._common import add_store_command, require_module
from hicache_store.errors import UsageError
from hicache_store.ops.config import layered, require, resolve


def register(subparsers: Any) -> None:
    parser = add_store_command(
        subparsers, "events",
        help="publish a store's page changes as KV events for routers", doc=__doc__)
    parser.add_argument("--namespace", metavar="DIGEST",
                        help="only this namespace's pages (default: every namespace's)")
    parser.add_argument("--pub", metavar="ADDR", required=True,
                        help="the PUB address bound, e.g. tcp://127.0.0.1:5557 or ipc:///run/kv")
    parser.add_argument("--replay", metavar="ADDR", help="the replay (ROUTER) address bound")
    parser.add_argument("--topic", default="", help="the topic frame (default: empty)")
    parser.add_argument("--history", type=int, default=10_000,
                        help="batches held for replay (default: 10000)")
    parser.add_argument("--interval", type=float, default=0.05,
                        help="seconds between looks at the change feed (default: 0.05)")
    layered(parser, section="events")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolve(args)
    url = require(args, "url", "a backend URL")
    if not args.interval > 0:
        raise UsageError(f"--interval must be positive, got {args.interval}")
    require_module("zmq", "KV events")
    from hicache_store import sync
    from hicache_store.backends.errors import NotSupportedError
    from hicache_store.events.publisher import EventPublisher, PublisherConfig
    from hicache_store.events.store import StoreEvents
    from hicache_store.ops.store import open_store

    try:
        config = PublisherConfig(args.pub, args.replay, topic=args.topic, history=args.history,
                                 bind=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    backend = open_store(url, existing=True)
    if not backend.capabilities.change_feed:
        sync.close(backend)
        raise UsageError(f"{url}: store-wide events need a store with a change feed (docs/guide/"
                         "routers.md, \"What each backend can report\")")
    try:
        publisher = EventPublisher(config)
    except OSError as exc:
        sync.close(backend)
        raise UsageError(str(exc)) from None
    try:
        watcher = StoreEvents(backend, publisher, namespace=args.namespace)
    except NotSupportedError as exc:
        publisher.close()
        sync.close(backend)
        raise UsageError(str(exc)) from None
    print(f"publishing {publisher.endpoint} replay {publisher.replay_endpoint or '-'}",
          flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a service manager's stop: clean
    try:
        watcher.run(stop, args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        publisher.close()
        sync.close(backend)
    return 0
