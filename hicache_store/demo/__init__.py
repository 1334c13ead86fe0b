"""Demo and benchmark harness: outside the library's core (no core module imports it).

* ``demo.engine``: the mini engine (``MiniLlama``, a seeded Llama-style decoder over a paged
  ``DeviceKVPool``) and its prepopulation source (``demo.engine.source.MiniEngineSource``).
* ``demo.bench``: the drivers behind ``hicache-store bench multiturn | pd | trace`` (workloads,
  tier setups, the P/D worker processes, trace formats, replay and the policy simulator).
* ``demo.hybrid`` / ``demo.draft``: hybrid and draft mini models with their component pools.
* ``demo.launch`` / ``demo.sharded``: rank processes over gloo (``RankPool``) and one rank of a
  sharded deployment of the mini engine (``ShardedEngine``).

Only the command modules that drive it (``bench multiturn|pd|trace``, ``prepopulate
--mini-engine``), the ``bench/`` scripts and the tests import it; ``tests/test_layering.py``
checks that.
"""
