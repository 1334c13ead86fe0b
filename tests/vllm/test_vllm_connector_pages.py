"""The connector with a page size other than vLLM's block size, in a real vLLM 0.32 (block 32).

Start-up (no engine): ``page_size`` must be a multiple or a divisor of the block size, and
other than the block size only for one group of full-attention MHA; the namespace carries it.

Engines (one at a time in this process, in one module fixture): a reference without the
connector, then per page size (64: a page of two blocks; 16: a block of two pages) an engine
with the connector on a fresh store, no L2 (every load from the store):

1. prompt ``A`` (245 tokens) is computed and saved;
2. vLLM's prefix cache is emptied and ``X`` (``A``'s first 96 tokens, then others) computed:
   vLLM now holds ``A``'s first three blocks itself;
3. ``A`` + more: vLLM's three blocks are its own, the rest of ``A``'s stored prefix comes from
   the store: with page 64 the page over blocks 2-3 is read and only block 3 written; with
   page 16 the fifteenth page (half a block) is left for vLLM to compute;
4. the test-only altered-bytes switch: the same served prefix, other tokens (the check can
   fail).

The same per page size with the connector's L2 (``l2_mib``): after step 1 every object is
deleted from the store, so step 3's pages (the page over blocks 2-3 with page 64, the half-block
pages with page 16) are served from L2 alone, and step 4's altered pages are L2's.

Token ids are compared exactly with the reference (float32, greedy); the tokens served are read
from vLLM's own counters and the connector's.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm_support import close_llm, connector_config, make_llm, sentence

from hicache_store.integrations.vllm._config import ConnectorConfig
from hicache_store.integrations.vllm.connector import deployment
from hicache_store.layout.blocks import BlockPages
from hicache_store.layout.errors import ConfigError

BLOCK = 32
PAGES = (64, 16)
PROMPT = 245  # tokens of A: 3 pages of 64, 15 pages of 16 (the last one half a block)
HELD = 96  # tokens of A that vLLM holds itself in step 3: three blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# -- start-up, without an engine --------------------------------------------------------------


def kv_config(*specs: Any) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
        for i, spec in enumerate(specs)])


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)


def plan(*specs: Any, **config: Any) -> Any:
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1),
        model_config=SimpleNamespace(
            use_mla=False, model="tiny", get_total_num_hidden_layers=lambda: len(specs),
            get_total_num_kv_heads=lambda: 2))
    return deployment(ConnectorConfig(**config), vllm_config,  # type: ignore[arg-type]
                      kv_config(*specs))


@pytest.mark.parametrize("page", [BLOCK, 2 * BLOCK, 4 * BLOCK, BLOCK // 2, BLOCK // 4])
def test_a_multiple_or_a_divisor_of_the_block_is_the_namespaces_page(page: int) -> None:
    namespace, _, parts = plan(full(), page_size=page)
    assert parts is None and namespace.page_size == page
    if page != BLOCK:  # pages of one size are never read as another's
        assert namespace.digest != plan(full())[0].digest


@pytest.mark.parametrize("page", [24, 48, 96 + 16])
def test_a_page_neither_a_multiple_nor_a_divisor_is_refused(page: int) -> None:
    with pytest.raises(ConfigError, match=rf"^HiCacheStoreConnector: page_size {page} must be "
                       rf"a multiple or a divisor of vLLM's block size {BLOCK}$"):
        plan(full(), page_size=page)


def test_another_page_for_a_model_of_several_groups_is_refused() -> None:
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                               dtype=torch.float32, sliding_window=64)
    assert plan(window, full(), page_size=BLOCK)[2] is not None  # the block size: served
    with pytest.raises(ConfigError, match=r"page_size 64 other than vLLM's block size 32 is "
                       "supported for one KV cache group of full-attention MHA only"):
        plan(window, full(), page_size=64)


# -- real engines -------------------------------------------------------------------------------


def generate(llm: Any, prompt: list[int]) -> list[int]:
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], GREEDY, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def tokenize(model_dir: Path, text: str) -> list[int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return list(tok(text, add_special_tokens=False)["input_ids"])


@dataclasses.dataclass
class Prompts:
    a: list[int]
    x: list[int]  # A's first HELD tokens, then others
    more: list[int]  # A, then more
    altered: list[int]  # A, then other more

    def all(self) -> list[list[int]]:
        return [self.a, self.x, self.more, self.altered]


@dataclasses.dataclass
class Run:
    """One engine's outputs (``Prompts.all`` order) and what served step 3 and step 4."""

    outputs: list[list[int]]
    local: float  # vLLM's own prefix hits in step 3 (tokens)
    external: float  # tokens vLLM took from the connector in step 3
    loaded: int  # tokens the connector restored in step 3
    altered_external: float  # tokens vLLM took from the connector in step 4
    saved_pages: int
    l2_hits: int = 0  # pages the connector's L2 served in step 3
    read_bytes: int = 0  # bytes the connector read from the store in step 3


def empty_store(root: Path) -> None:
    """Delete every object (and everything else) under the file store ``root``."""
    assert any(p.is_file() and "_L" in p.name for p in root.rglob("*"))
    for child in root.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def run_engine(llm: Any, prompts: Prompts, *, connector: bool, emptied: Path | None = None) -> Run:
    """The steps of the module docstring; ``emptied``: the store to empty after step 1."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    outputs = [generate(llm, prompts.a)]
    worker = get_kv_transfer_group() if connector else None
    if worker is not None:
        worker.flush()
    if emptied is not None:
        empty_store(emptied)
    assert llm.reset_prefix_cache()
    outputs.append(generate(llm, prompts.x))
    if worker is not None:
        worker.flush()
    metrics = worker.metrics if worker is not None else {}
    before = [counter(llm, "vllm:prefix_cache_hits"),
              counter(llm, "vllm:external_prefix_cache_hits"),
              metrics.get("tokens_loaded", 0), metrics.get("l2_hit_pages", 0),
              metrics.get("bytes_loaded", 0)]
    outputs.append(generate(llm, prompts.more))
    local = counter(llm, "vllm:prefix_cache_hits") - before[0]
    external = counter(llm, "vllm:external_prefix_cache_hits") - before[1]
    loaded = metrics.get("tokens_loaded", 0) - before[2]
    l2_hits = metrics.get("l2_hit_pages", 0) - before[3]
    read_bytes = metrics.get("bytes_loaded", 0) - before[4]
    assert llm.reset_prefix_cache()
    if worker is not None:
        worker.config = dataclasses.replace(worker.config, test_alter_loaded_kv=True)
    before_altered = counter(llm, "vllm:external_prefix_cache_hits")
    try:
        outputs.append(generate(llm, prompts.altered))
    finally:
        if worker is not None:
            worker.config = dataclasses.replace(worker.config, test_alter_loaded_kv=False)
    altered_external = counter(llm, "vllm:external_prefix_cache_hits") - before_altered
    saved = worker.metrics["pages_saved"] if worker is not None else 0
    return Run(outputs, local, external, loaded, altered_external, saved, l2_hits, read_bytes)


@pytest.fixture(scope="module")
def runs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int | None, Run]:
    """The reference (key ``None``) and one engine per page size, one after another (vLLM
    keeps one worker-side connector per process)."""
    words = tokenize(tiny_llama, sentence(0, 400))
    a = words[:PROMPT]
    prompts = Prompts(a, a[:HELD] + words[300:340], a + words[260:290], a + words[330:360])
    out: dict[int | None, Run] = {}
    for page in (None, *PAGES):
        transfer = None if page is None else connector_config({
            "url": f"file://{tmp_path_factory.mktemp(f'store-{page}')}", "page_size": page,
            "l2_mib": 0})
        llm = make_llm(tiny_llama, kv_transfer_config=transfer, block_size=BLOCK)
        try:
            out[page] = run_engine(llm, prompts, connector=page is not None)
        finally:
            close_llm(llm)
    return out


@pytest.mark.slow  # three engines
@pytest.mark.parametrize("page", PAGES)
def test_tokens_equal_recompute_with_the_prefix_served_from_the_store(
    runs: dict[int | None, Run], page: int
) -> None:
    run, reference = runs[page], runs[None]
    assert run.outputs[:3] == reference.outputs[:3]
    assert run.saved_pages > 0
    # vLLM held A's first three blocks itself; the store served the whole blocks its pages
    # cover after them, no more (page 16: 15 pages are 7.5 blocks, so 7).
    geometry = BlockPages(page, BLOCK)
    stored = geometry.pages_of(PROMPT)
    expected = geometry.hit_tokens(stored) - HELD
    assert run.local >= HELD
    assert (run.external, run.loaded) == (expected, expected)
    assert expected == {64: 96, 16: 128}[page]


@pytest.mark.slow  # three engines
@pytest.mark.parametrize("page", PAGES)
def test_altered_bytes_do_change_the_tokens(runs: dict[int | None, Run], page: int) -> None:
    """The check above can fail: the same prefix served with altered bytes gives other
    tokens."""
    run, reference = runs[page], runs[None]
    # nothing of vLLM's own this time: A's every stored page that ends a whole block
    assert run.altered_external == BlockPages(page, BLOCK).hit_tokens(PROMPT // page) > 0
    assert run.outputs[3] != reference.outputs[3]


@pytest.fixture(scope="module")
def l2_runs(tiny_llama: Path, runs: dict[int | None, Run],
            tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    """One engine per page size with the connector's L2, the store emptied after step 1 (the
    engines of ``runs`` are closed: vLLM keeps one worker-side connector per process)."""
    words = tokenize(tiny_llama, sentence(0, 400))
    a = words[:PROMPT]
    prompts = Prompts(a, a[:HELD] + words[300:340], a + words[260:290], a + words[330:360])
    out: dict[int, Run] = {}
    for page in PAGES:
        root = tmp_path_factory.mktemp(f"store-l2-{page}")
        transfer = connector_config({"url": f"file://{root}", "page_size": page, "l2_mib": 64})
        llm = make_llm(tiny_llama, kv_transfer_config=transfer, block_size=BLOCK)
        try:
            out[page] = run_engine(llm, prompts, connector=True, emptied=root)
        finally:
            close_llm(llm)
    return out


@pytest.mark.slow  # five engines
@pytest.mark.parametrize("page", PAGES)
def test_l2_serves_pages_of_another_size_with_the_tokens_of_recompute(
    runs: dict[int | None, Run], l2_runs: dict[int, Run], page: int
) -> None:
    run, reference = l2_runs[page], runs[None]
    assert run.outputs[:3] == reference.outputs[:3]
    # The prefix the store served without L2, served with the store empty: from L2 alone,
    # every page after vLLM's three blocks (page 64: the page over blocks 2-3, of which only
    # block 3 is written; page 16: 14 pages, the fifteenth half a block left to vLLM).
    expected = runs[page].external
    assert run.local >= HELD
    assert (run.external, run.loaded) == (expected, expected) == ({64: 96, 16: 128}[page],) * 2
    geometry = BlockPages(page, BLOCK)
    assert run.l2_hits == geometry.pages_of(HELD + expected) - geometry.pages_of(HELD) > 0
    assert run.read_bytes == 0


@pytest.mark.slow  # five engines
@pytest.mark.parametrize("page", PAGES)
def test_altered_l2_pages_of_another_size_do_change_the_tokens(
    runs: dict[int | None, Run], l2_runs: dict[int, Run], page: int
) -> None:
    run, reference = l2_runs[page], runs[None]
    assert run.altered_external == BlockPages(page, BLOCK).hit_tokens(PROMPT // page) > 0
    assert run.outputs[3] != reference.outputs[3]
