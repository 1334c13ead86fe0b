from collections.abc import Sequence

from typing_extensions import Buffer

def read_files(
    items: Sequence[tuple[str, Sequence[Buffer], int, int, bool]],
) -> list[tuple[int, int, int, int]]: ...
