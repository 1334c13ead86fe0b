"""Build hook for the one optional C accelerator; all metadata lives in pyproject.toml.

``hicache_store.layout._chain`` hashes token pages with OpenSSL. It is optional: when it cannot
be built (no compiler, no OpenSSL headers) the install still succeeds and the pure-Python chain
in ``hicache_store.layout.hashing`` is used, with identical results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicache_store.layout._chain",
            sources=["layout/_chain.c"],
            libraries=["crypto"],
            optional=True,
        )
    ]
)
