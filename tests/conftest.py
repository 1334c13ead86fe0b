"""Shared by every test folder: this directory is on ``sys.path`` (pytest's rootdir-relative
import of a ``conftest.py`` without ``__init__.py``), so tests import ``_serve`` by name."""
