"""Build hook: where the packages are, and the optional C accelerators; the metadata (name,
version, dependencies, extras, entry points) lives in pyproject.toml.

**Packages.** ``layout/``, ``kernels/`` and ``backends/`` sit beside ``hicache_store/`` in the
checkout and install as ``hicache_store.layout``, ``.kernels`` and ``.backends``
(``PACKAGE_DIR``). Every package under those folders is found by walking them (a folder with an
``__init__.py``), so a new subpackage is in the wheel without being listed anywhere; the
install check (``tests/install/check_wheel.py``, part of ``make test``) builds the wheel and
imports every module from it.

**Accelerators.** ``hicache_store.layout._chain`` hashes token pages with OpenSSL;
``hicache_store.layout._keys`` checks and fingerprints batches of storage keys (no library);
``hicache_store.backends._fileio`` reads (with checksums) and writes a batch of files with the
GIL released (the file backend's I/O). All are optional: when one cannot be built (no
compiler, no OpenSSL headers) the install still succeeds and the pure-Python code
(``hicache_store.layout.hashing``, ``hicache_store.layout.keys``,
``hicache_store.backends.file``) is used, with identical results.
"""

from setuptools import Extension, find_packages, setup

#: the distribution's top-level packages and the folder each is in (the layers of
#: ARCHITECTURE.md: ``tests/test_layering.py`` reads the same mapping).
PACKAGE_DIR = {
    "hicache_store": "hicache_store",
    "hicache_store.layout": "layout",
    "hicache_store.kernels": "kernels",
    "hicache_store.backends": "backends",
}


def packages() -> list[str]:
    """Every package of the distribution: each of ``PACKAGE_DIR`` and its subpackages."""
    found = []
    for package, folder in PACKAGE_DIR.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_packages(folder)]
    return found


setup(
    package_dir=PACKAGE_DIR,
    packages=packages(),
    ext_modules=[
        Extension(
            "hicache_store.layout._chain",
            sources=["layout/_chain.c"],
            libraries=["crypto"],
            optional=True,
        ),
        Extension("hicache_store.layout._keys", sources=["layout/_keys.c"], optional=True),
        Extension("hicache_store.backends._fileio", sources=["backends/_fileio.c"], optional=True),
    ],
)
