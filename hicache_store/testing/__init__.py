"""``hicache_store.testing``: the public conformance kit for storage backends.

``BackendTests`` is a pytest base class: subclass it with a ``backend`` fixture and the two
oracle hooks ``oracle_get`` / ``oracle_set`` and every contract of
``hicache_store.backends.Backend`` is checked against your backend, switched by its
capabilities. ``RetentionTests`` adds the retention contract (pins, priorities, the pin
budget, deadlines) for bounded backends that declare ``capabilities.retention``;
``CapacityUsageTests`` the ``capacity_usage`` contract (the bytes used as the bound counts them).
``run_backend_state_machine`` is the Hypothesis model-based check on its own.
Needs pytest, pytest-asyncio and hypothesis (the ``dev`` extra).
"""

from __future__ import annotations

from .backend import INVALID_KEYS, BackendTests, framed_object, pattern
from .capacity import CapacityUsageTests
from .retention import Clock, RetentionTests
from .stateful import BackendModelMachine, run_backend_state_machine

__all__ = [
    "INVALID_KEYS",
    "BackendModelMachine",
    "BackendTests",
    "CapacityUsageTests",
    "Clock",
    "RetentionTests",
    "framed_object",
    "pattern",
    "run_backend_state_machine",
]
