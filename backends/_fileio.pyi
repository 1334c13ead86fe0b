from collections.abc import Sequence

from typing_extensions import Buffer

def read_files(
    items: Sequence[
        tuple[str, Sequence[Buffer], int, int, bool]
        | tuple[str, Sequence[Buffer], int, int, bool, Sequence[tuple[int, int]]]
    ],
) -> list[tuple[int, int, int, int, tuple[int, ...]]]: ...

class ReadJob:
    def done(self) -> bool: ...
    def wait(self) -> list[tuple[int, int, int, int, tuple[int, ...]]]: ...

def start_read_files(
    items: Sequence[
        tuple[str, Sequence[Buffer], int, int, bool]
        | tuple[str, Sequence[Buffer], int, int, bool, Sequence[tuple[int, int]]]
    ],
) -> ReadJob: ...
def bind_xxh3(path: str) -> bool: ...
def write_files(items: Sequence[tuple[str, str, Buffer, bool, int]]) -> list[tuple[int, int]]: ...

class WriteJob:
    def done(self) -> bool: ...
    def wait(self) -> tuple[list[tuple[int, int]], float | None, float | None]: ...

def start_write_files(items: Sequence[tuple[str, str, Buffer, bool, int]],
                      start_by: float) -> WriteJob: ...
