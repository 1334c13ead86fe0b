"""A Hypothesis state machine that checks a backend against a plain ``dict`` model.

Rules put, rewrite, read (whole and ranged), probe, stat, delete and list random keys from a
small pool (so keys collide often), and after every step the backend must agree with the
model. Async calls go through the sync bridge, so the machine runs in a worker thread.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hicache_store._sync import run_sync
from hicache_store.backends.base import Backend
from hicache_store.backends.errors import InvalidRangeError
from hicache_store.backends.types import ByteRange

#: the key pool: short, overlapping prefixes so that listing by prefix is exercised.
KEY_POOL: tuple[str, ...] = ("a0", "a1", "a10", "b0", "b1", "c", "F-0", "F_1")
keys_st = st.sampled_from(KEY_POOL)
values_st = st.binary(min_size=0, max_size=600)


class BackendModelMachine(RuleBasedStateMachine):
    """Checks ``self.backend`` (set by ``run_backend_state_machine``) against a dict."""

    backend: Backend

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, bytes] = {}

    @initialize()
    def start_empty(self) -> None:
        run_sync(self.backend.delete(list(KEY_POOL)))

    @rule(key=keys_st, value=values_st)
    def put(self, key: str, value: bytes) -> None:
        run_sync(self.backend.put([key], [value]))
        self.model[key] = value

    @rule(items=st.lists(st.tuples(keys_st, values_st), min_size=1, max_size=4, unique_by=lambda t: t[0]))
    def put_batch(self, items: list[tuple[str, bytes]]) -> None:
        run_sync(self.backend.put([k for k, _ in items], [v for _, v in items]))
        self.model.update(items)

    @rule(key=keys_st)
    def get(self, key: str) -> None:
        expected = self.model.get(key)
        buf = bytearray(len(expected) + 3 if expected is not None else 8)
        (n,) = run_sync(self.backend.get_into([key], [buf]))
        if expected is None:
            assert n is None, f"{key}: read {n} bytes of a deleted or never-written key"
        else:
            assert n == len(expected), f"{key}: read {n} bytes of a {len(expected)}-byte object"
            assert bytes(buf[:n]) == expected, f"{key}: wrong bytes"

    @rule(key=keys_st, start=st.integers(0, 700), length=st.integers(1, 700))
    def get_range(self, key: str, start: int, length: int) -> None:
        expected = self.model.get(key)
        rng = ByteRange.of(start, length)
        buf = bytearray(length)
        if expected is not None and rng.end > len(expected):
            try:
                run_sync(self.backend.get_into([key], [buf], [rng]))
            except InvalidRangeError:
                return
            raise AssertionError(f"{key}: range {rng} past a {len(expected)}-byte object")
        (n,) = run_sync(self.backend.get_into([key], [buf], [rng]))
        if expected is None:
            assert n is None
        else:
            assert n == length
            assert bytes(buf) == expected[start : start + length]

    @rule(key=keys_st)
    def delete(self, key: str) -> None:
        (removed,) = run_sync(self.backend.delete([key]))
        assert removed == (key in self.model)
        self.model.pop(key, None)

    @rule(keys=st.lists(keys_st, min_size=1, max_size=6))
    def exists(self, keys: list[str]) -> None:
        assert run_sync(self.backend.exists(keys)) == [k in self.model for k in keys]

    @rule(keys=st.lists(keys_st, min_size=1, max_size=6))
    def exists_prefix_length(self, keys: list[str]) -> None:
        expected = 0
        for key in keys:
            if key not in self.model:
                break
            expected += 1
        assert run_sync(self.backend.exists_prefix_length(keys)) == expected

    @rule(key=keys_st)
    def stat(self, key: str) -> None:
        (found,) = run_sync(self.backend.stat([key]))
        if key in self.model:
            assert found is not None
            assert found.size == len(self.model[key])
        else:
            assert found is None

    @precondition(lambda self: self.backend.capabilities.listing)
    @rule(prefix=st.sampled_from(("", "a", "a1", "F", "F_", "Z")))
    def list_prefix(self, prefix: str) -> None:
        async def collect() -> list[str]:
            return [key async for key in self.backend.list_prefix(prefix)]

        listed = run_sync(collect())
        assert len(listed) == len(set(listed)), "a key was listed twice"
        assert set(listed) == {k for k in self.model if k.startswith(prefix)}

    @invariant()
    def keys_agree(self) -> None:
        hits = run_sync(self.backend.exists(list(KEY_POOL)))
        assert dict(zip(KEY_POOL, hits, strict=True)) == {k: k in self.model for k in KEY_POOL}


def run_backend_state_machine(
    backend: Backend, *, max_examples: int = 20, step_count: int = 15, **extra: Any
) -> None:
    """Run the model machine against ``backend`` (blocking; use a worker thread from async).

    The backend must have room for a few kilobytes (no eviction during the run)."""

    class Machine(BackendModelMachine):
        pass

    Machine.backend = backend
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=max_examples, stateful_step_count=step_count, deadline=None, **extra
        ),
    )
