"""Logical KV dtypes known to the layout layer.

The layout layer does byte arithmetic only, so a dtype here is a name and an item size. Names
follow torch's spelling (``bfloat16``, ``float8_e4m3fn``) so that an engine's ``str(dtype)``
without the ``torch.`` prefix can be used directly. Two dtypes of the same size are still
different namespaces: bf16 bytes must never be served to an fp16 reader.
"""

from __future__ import annotations

from types import MappingProxyType

#: item size in bytes of every logical KV dtype the layout accepts.
KV_DTYPE_ITEMSIZE: MappingProxyType[str, int] = MappingProxyType(
    {
        "float32": 4,
        "bfloat16": 2,
        "float16": 2,
        "float8_e4m3fn": 1,
        "float8_e4m3fnuz": 1,
        "float8_e5m2": 1,
        "float8_e5m2fnuz": 1,
        "uint8": 1,
        "int8": 1,
    }
)


def normalize_dtype(name: str) -> str:
    """Return the canonical dtype name (``torch.bfloat16`` -> ``bfloat16``).

    Raises ``ValueError`` naming the accepted dtypes for anything unknown.
    """
    canonical = str(name).removeprefix("torch.")
    if canonical not in KV_DTYPE_ITEMSIZE:
        known = ", ".join(sorted(KV_DTYPE_ITEMSIZE))
        raise ValueError(f"dtype: unknown KV dtype {name!r}; expected one of {known}")
    return canonical


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a (canonical or ``torch.``-prefixed) KV dtype."""
    return KV_DTYPE_ITEMSIZE[normalize_dtype(name)]


def is_float8(name: str) -> bool:
    """Whether a (canonical or ``torch.``-prefixed) KV dtype is a float8 format: KV that was
    quantized with scales, and means nothing without them."""
    return str(name).removeprefix("torch.").startswith("float8_")
