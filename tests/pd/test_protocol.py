"""The P/D control messages: strict decoding and the boundary arithmetic both sides share."""

from __future__ import annotations

import json

import pytest

from hicache_store.pd.protocol import (
    MESSAGES,
    Bye,
    Failed,
    Hello,
    PrefillDone,
    PrefillRequest,
    ProtocolError,
    Welcome,
    check_boundary,
    decode,
    suffix_pages,
)

SAMPLES = [
    Hello(1, "ab" * 8, 16, 65536, "tcp", "127.0.0.1:5000", 140_000_000, 64, {"window": 8}),
    Welcome(1, "ab" * 8),
    PrefillRequest(7, [1, 2, 3, 4, 5], 4, "cd" * 32, [3], [9]),
    PrefillDone(7, 4, 1, 65536, 0, 42, 0.25, 0.01),
    Failed(-1, "no"),
    Bye(),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_every_message_round_trips(message: object) -> None:
    assert decode(message.encode()) == message  # type: ignore[attr-defined]


def test_every_message_kind_has_a_sample() -> None:
    assert {m.kind for m in SAMPLES} == set(MESSAGES)


def raw(**fields: object) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (raw(type="steal"), "unknown control message type"),
        (raw(rid=1), "unknown control message type None"),
        (raw(type="failed", rid=1), "missing field 'error'"),
        (raw(type="failed", rid=1, error="x", extra=1), "unknown fields"),
        (raw(type="failed", rid="1", error="x"), "failed.rid: expected an integer"),
        (raw(type="failed", rid=True, error="x"), "failed.rid: expected an integer"),
        (raw(type="failed", rid=-2, error="x"), "failed.rid: out of range"),
        (raw(type="failed", rid=1, error=5), "failed.error: expected a string"),
        (
            raw(type="prefill", rid=1, tokens=[1, -3], boundary=0, boundary_hash="", landing=[0]),
            "prefill.tokens: expected a list of non-negative integers",
        ),
        (
            raw(type="prefill", rid=1, tokens=[1], boundary=0, boundary_hash="", landing=[0.5]),
            "prefill.landing",
        ),
        (
            raw(type="done", rid=1, boundary=0, pages=1, bytes=1, prefill_cached=0,
                first_token=0, prefill_s=-1.0, transfer_s=0.0),
            "done.prefill_s: expected a non-negative number",
        ),
        (raw(type="hello", version=1), "missing field"),
    ],
)
def test_malformed_messages_are_one_protocol_error(data: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode(data)


def test_the_boundary_is_a_page_aligned_prefix_that_leaves_a_token() -> None:
    check_boundary(17, 16, 4)
    check_boundary(1, 0, 4)
    for prompt, boundary in ((16, 16), (17, 6), (17, -4), (17, 20), (0, 0)):
        with pytest.raises(ProtocolError):
            check_boundary(prompt, boundary, 4)
    assert suffix_pages(17, 16, 4) == 1
    assert suffix_pages(17, 0, 4) == 5
    assert suffix_pages(16, 12, 4) == 1
    assert suffix_pages(16, 0, 4) == 4
