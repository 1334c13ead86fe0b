"""Async storage backends: the ``Backend`` ABC, the registry and the built-in backends."""
