"""Keeps the QNN libraries' own console chatter out of the CLI's output.

QAIRT and ExecuTorch's QNN runtime print from C++ straight to file descriptors 1
and 2 (``[INFO] [Qnn ExecuTorch]: ...``, ``LIBNATIVE: ...``), in the middle of our
tables. The CLI captures both descriptors around lowering and execution and shows
the captured text only when something fails. Progress bars keep the real terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

_terminal = None


def terminal():
    """The stream progress bars should draw on (the real stderr while capturing)."""
    return _terminal if _terminal is not None else sys.stderr


@contextlib.contextmanager
def captured_native_output(enabled: bool = True) -> Iterator[list[str]]:
    """Redirects fds 1 and 2 to a temporary file; yields a list that receives the text.

    On an exception the captured text is written to the real stderr before the
    exception propagates, so nothing a failure printed is lost.
    """
    global _terminal
    captured: list[str] = []
    if not enabled:
        yield captured
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log = tempfile.TemporaryFile(mode="w+b")
    previous_terminal = _terminal
    _terminal = os.fdopen(os.dup(saved_err), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    failed = False
    try:
        yield captured
    except BaseException:
        failed = True
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        _terminal.close()
        _terminal = previous_terminal
        log.seek(0)
        captured.append(log.read().decode(errors="replace"))
        log.close()
        if failed and captured[0].strip():
            tail = "\n".join(captured[0].strip().splitlines()[-40:])
            print(f"--- output of the QNN libraries (last lines) ---\n{tail}\n---", file=sys.stderr)
