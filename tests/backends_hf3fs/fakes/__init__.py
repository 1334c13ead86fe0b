"""FAKES for the hf3fs tests. Nothing here talks to 3FS; see ``hf3fs_fuse/io.py``."""
