"""FAKE ``hf3fs_fuse`` package for tests: NOT 3FS, NOT the real client.

Only ``hf3fs_fuse.io`` is faked (``io.py``); tests install it into ``sys.modules`` for the
duration of one test. See ``io.py`` for what it does and what it checks.
"""
