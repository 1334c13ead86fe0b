"""``Arena`` and ``Arenas``: aligned slots made a block at a time, handed out and taken back;
one arena per slot size."""

from __future__ import annotations

import numpy as np
import pytest

import hicache_store.objects.arena as arena_module
from hicache_store.objects.arena import Arena, Arenas, round_up


def address(slot: memoryview) -> int:
    return int(np.frombuffer(slot, dtype=np.uint8).ctypes.data)


def test_arena_hands_out_aligned_slots_and_takes_them_back() -> None:
    arena = Arena(5000, block_slots=2)
    a, b = arena.take(), arena.take()
    assert len(a) == len(b) == 8192
    assert {address(s) % 4096 for s in (a, b)} == {0}
    assert address(a) != address(b)
    arena.give(a)
    assert arena.take() is a
    assert arena.blocks == 1
    arena.take()
    assert arena.blocks == 2 and arena.slots == 4
    with pytest.raises(ValueError, match="not one of mine"):
        arena.give(memoryview(bytearray(10)))


@pytest.mark.parametrize(("slot_bytes", "block_slots"), [(0, 1), (4096, 0), (-1, 8)])
def test_arena_refuses_an_empty_shape(slot_bytes: int, block_slots: int) -> None:
    with pytest.raises(ValueError, match="arena"):
        Arena(slot_bytes, block_slots=block_slots)


def test_round_up_is_to_the_direct_alignment() -> None:
    assert [round_up(n) for n in (1, 4095, 4096, 4097)] == [4096, 4096, 4096, 8192]
    assert round_up(10, 8) == 16


def test_arenas_keep_one_arena_per_slot_size() -> None:
    arenas = Arenas(block_slots=3)
    small = arenas.arena(100)
    assert arenas.arena(4096) is small  # the same slot size once rounded up
    big = arenas.arena(4097)
    assert big is not small and big.slot_bytes == 8192 and big.block_slots == 3
    assert {a.slot_bytes for a in arenas.made()} == {4096, 8192}
    slot = small.take()
    with pytest.raises(ValueError, match="not one of mine"):
        big.give(slot)


def test_arenas_pass_populate_to_every_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[int, bool]] = []
    real = arena_module.aligned_buffer

    def recording(nbytes: int, *, populate: bool = False) -> memoryview:
        made.append((nbytes, populate))
        return real(nbytes, populate=populate)

    monkeypatch.setattr(arena_module, "aligned_buffer", recording)
    Arenas(block_slots=1, populate=True).arena(5000).take()
    Arenas(block_slots=2).arena(5000).take()
    assert made == [(8192, True), (16384, False)]

