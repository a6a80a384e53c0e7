"""A progress bar for long loops, drawn only when stderr is a terminal.

CI logs and pipes stay quiet; QNN_MUTBUF_PROGRESS=1 forces the bar, =0 hides it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def _stream():
    from qnn_mutbuf.native_output import terminal

    return terminal()


def progress_enabled() -> bool:
    setting = os.environ.get("QNN_MUTBUF_PROGRESS")
    if setting is not None:
        return setting not in ("", "0", "false", "no")
    stream = _stream()
    return bool(getattr(stream, "isatty", lambda: False)())


def progress(items: Iterable[T], description: str) -> Iterator[T]:
    """Yields `items`, redrawing one status line on stderr per item."""
    if not progress_enabled():
        yield from items
        return
    total = len(items) if isinstance(items, Sized) else None
    start = time.monotonic()
    for index, item in enumerate(items):
        _draw(description, index, total, start)
        yield item
    _draw(description, total or 0, total, start, final=True)


@contextmanager
def stage(description: str) -> Iterator[None]:
    """Announces one stage of a longer job and how long it took."""
    if not progress_enabled():
        yield
        return
    start = time.monotonic()
    stream = _stream()
    stream.write(f"{description} ...")
    stream.flush()
    try:
        yield
    finally:
        stream.write(f" {time.monotonic() - start:.1f}s\n")
        stream.flush()


def _draw(
    description: str, done: int, total: int | None, start: float, final: bool = False
) -> None:
    elapsed = time.monotonic() - start
    if total:
        width = 24
        filled = int(width * done / total)
        bar = "#" * filled + "-" * (width - filled)
        text = f"\r{description} [{bar}] {done}/{total} {elapsed:.1f}s"
    else:
        text = f"\r{description} {done} {elapsed:.1f}s"
    stream = _stream()
    stream.write(text + ("\n" if final else ""))
    stream.flush()
