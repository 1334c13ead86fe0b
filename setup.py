"""Build hook for the optional C accelerators; all metadata lives in pyproject.toml.

``hicache_store.layout._chain`` hashes token pages with OpenSSL; ``hicache_store.layout._keys``
checks and fingerprints batches of storage keys (no library); ``hicache_store.backends._fileio``
reads (with checksums) and writes a batch of files with the GIL released (the file backend's
I/O). All are optional: when one cannot be built (no compiler, no OpenSSL headers) the install still succeeds and the
pure-Python code (``hicache_store.layout.hashing``, ``hicache_store.layout.keys``,
``hicache_store.backends.file``) is used, with identical results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicache_store.layout._chain",
            sources=["layout/_chain.c"],
            libraries=["crypto"],
            optional=True,
        ),
        Extension("hicache_store.layout._keys", sources=["layout/_keys.c"], optional=True),
        Extension("hicache_store.backends._fileio", sources=["backends/_fileio.c"], optional=True),
    ]
)
