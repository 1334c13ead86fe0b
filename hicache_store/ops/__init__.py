"""Operator tools as a library: what the ``prepopulate`` and ``inspect`` commands call.

* ``ops.config``: settings precedence for every command (flags > env > config file > defaults).
* ``ops.manifest``: one manifest object per namespace (``M_{digest}``), written by every writer.
* ``ops.sources``: prompts (JSONL / text files) and KV sources (Hugging Face models; the demo's
  MiniLlama source lives in ``demo.engine.source``).
* ``ops.prepopulate``: compute prompts' KV and store it as every rank of a topology would.
* ``ops.inspection``: namespaces, objects and bytes in a store; verify and delete corrupt objects.
* ``ops.progress``: a dependency-free progress bar.

Heavy dependencies (torch, transformers) are imported only by the modules that need them.
"""
