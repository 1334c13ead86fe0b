"""Pack / unpack kernels between an engine's KV pools and the unified page layout."""
