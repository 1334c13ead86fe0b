"""A KV event subscriber process that keeps its view of the stored pages across publisher
restarts, as a router does (run as ``python view_subscriber.py PUB REPLAY OUT STOP``).

It applies every batch in sequence order: ``BlockStored`` adds pages, ``BlockRemoved`` drops
them, ``AllBlocksCleared`` drops every page. The resync rule of ``hicache_store.events.store``:
a batch numbered below the last one applied means the publisher restarted, and a gap means
batches were missed: either way it asks the replay socket (from 0 after a restart, else from
the first batch missed). After each batch it writes its view to ``OUT`` (one hex page hash a
line, then ``seq N``), replacing the file at once; it stops when the file ``STOP`` exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent))
from _kv_subscriber import Subscriber


def main(pub: str, replay: str, out: str, stop: str) -> None:
    sub = Subscriber(pub, replay)
    view: set[bytes] = set()
    last = -1

    def apply(batch: list[Any]) -> None:
        for event in batch[1]:
            if event["type"] == "AllBlocksCleared":
                view.clear()
            elif event["type"] == "BlockStored":
                view.update(event["block_hashes"])
            else:
                view.difference_update(event["block_hashes"])

    try:
        while not os.path.exists(stop):
            got = sub.recv(0.1)
            if got is None:
                continue
            seq, batch = got
            if seq != last + 1:  # a restart (lower) or a gap (higher): catch up by replay
                start = 0 if seq <= last else last + 1
                for old_seq, old in sub.replay(start):
                    if old_seq < seq:
                        apply(old)
            apply(batch)
            last = seq
            tmp = f"{out}.tmp"
            with open(tmp, "w") as f:
                f.write("".join(f"{h.hex()}\n" for h in sorted(view)) + f"seq {last}\n")
            os.replace(tmp, out)
    finally:
        sub.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
