"""``python -m hicache_store``: the same entry point as the ``hicache-store`` script."""

from __future__ import annotations

import sys

from hicache_store.cli import main

sys.exit(main())
