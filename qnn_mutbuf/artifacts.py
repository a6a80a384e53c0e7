"""Writing `.pte` files and their JSON sidecar atomically.

A half-written `.pte` that a phone then loads is worse than none, so every file is
written to a temporary name in the same folder and renamed into place.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_atomically(path: str | os.PathLike, data: bytes | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data.encode() if isinstance(data, str) else data)
        # mkstemp creates 0600; a program or report is an ordinary file (0666 - umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def sidecar_path(pte_path: str | os.PathLike) -> Path:
    """`out.pte` -> `out.json`."""
    return Path(pte_path).with_suffix(".json")


def write_sidecar(pte_path: str | os.PathLike, record: dict) -> Path:
    return write_atomically(sidecar_path(pte_path), json.dumps(record, indent=2) + "\n")


def read_sidecar(pte_path: str | os.PathLike) -> dict | None:
    path = sidecar_path(pte_path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())
