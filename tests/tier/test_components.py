"""Hit rules and the hybrid match: the longest prefix every needed component can resume."""

from __future__ import annotations

import random

import pytest

from hicache_store.layout.errors import InvalidNamespaceError
from hicache_store.layout.namespace import Grid, ModelShape, Namespace, kv_scales_digest
from hicache_store.tier.components import (
    ComponentSpec,
    HitRule,
    component_namespace,
    match_components,
)
from hicache_store.tier.radix import Tier

PAGE = 4
FULL = ComponentSpec("full", 0, HitRule.FULL)
SWA = ComponentSpec("swa", 1, HitRule.WINDOW, window_tokens=6)
SNAP = ComponentSpec("mamba", 2, HitRule.CHECKPOINT)
L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3


def test_pages_needed_per_rule() -> None:
    assert list(FULL.pages_needed(5, PAGE)) == [0, 1, 2, 3, 4]
    # prefix end at token 20, window of 6 tokens: tokens 14..19 live in pages 3 and 4
    assert list(SWA.pages_needed(5, PAGE)) == [3, 4]
    assert list(SWA.pages_needed(1, PAGE)) == [0]
    assert list(SNAP.pages_needed(5, PAGE)) == [4]
    for spec in (FULL, SWA, SNAP):
        assert list(spec.pages_needed(0, PAGE)) == []


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        ComponentSpec("swa", 1, HitRule.WINDOW)
    with pytest.raises(ValueError):
        ComponentSpec("full", 0, HitRule.FULL, window_tokens=3)
    with pytest.raises(ValueError):
        ComponentSpec("x", 1000, HitRule.FULL)
    with pytest.raises(ValueError):
        match_components([FULL, ComponentSpec("full", 1, HitRule.FULL)], {"full": []}, PAGE)


def test_full_only_is_the_resident_prefix() -> None:
    m = match_components([FULL], {"full": [L1, L2, L3, None, L1]}, PAGE)
    assert m.prefix_pages == 3
    assert m.restore["full"] == ((0, L1), (1, L2), (2, L3))
    assert m.limited_by == ("full",)
    m = match_components([FULL], {"full": [L1, L2]}, PAGE)
    assert m.prefix_pages == 2 and m.limited_by == ()  # the request itself ends there


def test_window_needs_only_the_last_pages() -> None:
    # old window pages gone: the match still reaches the end
    avail = {"full": [L2] * 6, "swa": [None, None, None, None, L3, L1]}
    m = match_components([FULL, SWA], avail, PAGE)
    assert m.prefix_pages == 6
    assert m.restore["swa"] == ((4, L3), (5, L1))
    # a hole inside the window at the end shortens it to where the window is complete
    avail = {"full": [L2] * 6, "swa": [L1, L1, L1, L1, None, L1]}
    m = match_components([FULL, SWA], avail, PAGE)
    assert m.prefix_pages == 4
    assert m.limited_by == ("swa",)


def test_missing_snapshot_shortens_to_last_checkpoint() -> None:
    avail = {"full": [L1] * 8, "mamba": [None, L3, None, L2, None, None, None, None]}
    m = match_components([FULL, SNAP], avail, PAGE)
    assert m.prefix_pages == 4
    assert m.restore["mamba"] == ((3, L2),)
    assert m.alone == {"full": 8, "mamba": 4}
    assert m.limited_by == ("mamba",)
    # no checkpoint at all: resume from scratch
    m = match_components([FULL, SNAP], {"full": [L1] * 3, "mamba": [None] * 3}, PAGE)
    assert m.prefix_pages == 0 and m.restore == {"full": (), "mamba": ()}


def test_limited_by_names_the_binding_components() -> None:
    """A component is binding when the match without it would be longer."""
    # window hole at page 5, checkpoints at 4 and 6 pages: without the window -> 6, without the
    # snapshots -> 5 (window pages 3, 4 intact); with both -> 4. Both bind, the KV does not.
    avail = {
        "full": [L1] * 6,
        "swa": [L1, L1, L1, L1, L1, None],
        "mamba": [None, None, None, L2, None, L3],
    }
    m = match_components([FULL, SWA, SNAP], avail, PAGE)
    assert m.prefix_pages == 4
    assert m.alone == {"full": 6, "swa": 5, "mamba": 6}
    assert m.limited_by == ("swa", "mamba")
    # every component ends at the same page: no single one shortens the match
    avail = {"full": [L1, L1, None], "swa": [L1, L1, None], "mamba": [None, L1, None]}
    m = match_components([FULL, SWA, SNAP], avail, PAGE)
    assert m.prefix_pages == 2 and m.limited_by == ()


def test_max_pages_cap() -> None:
    avail = {"full": [L1] * 4, "mamba": [L1, L1, L1, L1]}
    assert match_components([FULL, SNAP], avail, PAGE, max_pages=2).prefix_pages == 2
    assert match_components([FULL, SNAP], avail, PAGE, max_pages=-1).prefix_pages == 0


def _brute(specs: list[ComponentSpec], avail: dict[str, list[Tier | None]], n: int) -> int:
    for p in range(n, -1, -1):
        if all(avail[s.name][i] is not None for s in specs for i in s.pages_needed(p, PAGE)):
            return p
    return 0


def test_matches_brute_force() -> None:
    rng = random.Random(7)
    specs = [FULL, SWA, SNAP]
    choices: list[Tier | None] = [None, L1, L2, L3]
    for _ in range(300):
        n = rng.randrange(0, 12)
        avail = {
            s.name: [rng.choice(choices) if rng.random() < 0.5 else L1 for _ in range(n)]
            for s in specs
        }
        subset = [s for s in specs if rng.random() < 0.7] or [FULL]
        m = match_components(subset, avail, PAGE)
        assert m.prefix_pages == _brute(subset, avail, n)
        for s in subset:
            assert [i for i, _ in m.restore[s.name]] == list(s.pages_needed(m.prefix_pages, PAGE))


def test_a_float8_component_carries_the_models_scales() -> None:
    """A window of float8 KV is read under the model's scales, so other scales miss it too;
    a state component (not float8) keeps no scales; a float8 component of a model whose
    namespace has none is refused."""
    scales = kv_scales_digest([0.5], [0.25])
    model = Namespace.create("m", ModelShape.mha(4, 2, 8), "float8_e4m3fn", PAGE, Grid(4, 2),
                             kv_scales=scales)
    window = component_namespace(model, "swa", ModelShape.mha(2, 2, 8), "float8_e4m3fn",
                                 Grid(2, 2))
    assert window.kv_scales == scales
    other = component_namespace(
        Namespace.create("m", ModelShape.mha(4, 2, 8), "float8_e4m3fn", PAGE, Grid(4, 2),
                         kv_scales=kv_scales_digest([0.5], [0.5])),
        "swa", ModelShape.mha(2, 2, 8), "float8_e4m3fn", Grid(2, 2))
    assert other.digest != window.digest
    state = component_namespace(model, "mamba", ModelShape.mla(2, 64), "uint8", Grid(2, 1),
                                page_size=1)
    assert state.kv_scales == ""
    unscaled = Namespace.create("m", ModelShape.mha(4, 2, 8), "bfloat16", PAGE, Grid(4, 2))
    with pytest.raises(InvalidNamespaceError, match="the kv_scales of m's namespace"):
        component_namespace(unscaled, "swa", ModelShape.mha(2, 2, 8), "float8_e4m3fn",
                            Grid(2, 2))
