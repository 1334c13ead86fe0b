"""Model state beyond KV pages that the decode side needs to resume at the end of a prompt.

A full-attention model needs nothing but the KV pages. A hybrid model needs more at the point
decoding resumes: its sliding-window layers attend to the last ``window - 1`` prompt tokens,
which may lie before the decode side's boundary (a *fresh window tail*), and a recurrent layer
needs its state after the last prompt token. The decode side's cache keeps full-attention KV
only, so the prefill worker sends that state with every request: a fixed number of bytes per
request (``nbytes``), in ``rows(page_bytes)`` landing rows after the KV pages.

A ``StateCodec`` defines those bytes for one model; both workers build the same codec (the
handshake compares ``describe()``), the prefill worker's compute fills ``begin(n)``'s handle and
``encode`` turns it into bytes, the decode worker ``decode`` s them into its own handle.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch


class StateCodec(abc.ABC):
    """The per-request extra state of one model (see the module docstring)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What both workers must agree on (JSON values): compared in the handshake."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of state per request (fixed: a short prompt pads)."""

    def rows(self, page_bytes: int) -> int:
        """Landing rows of ``page_bytes`` the state occupies."""
        return math.ceil(self.nbytes / page_bytes)

    @abc.abstractmethod
    def begin(self, prompt_tokens: int) -> Any:
        """A fresh handle for a prompt of ``prompt_tokens`` tokens, for the prefill compute to
        fill (for example the window buffer and recurrent state the engine writes into)."""

    @abc.abstractmethod
    def encode(self, handle: Any) -> torch.Tensor:
        """The state of a filled handle as ``nbytes`` bytes (a uint8 CPU tensor)."""

    @abc.abstractmethod
    def decode(self, data: torch.Tensor, prompt_tokens: int) -> Any:
        """The decode side's handle from ``nbytes`` received bytes."""
