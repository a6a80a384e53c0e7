"""Builds the device-config forwarder (``htp_forwarder.c``) with the host C compiler.

The C source ships inside the package; it is compiled on first use into the staged
library folder. Building into a temporary name and renaming means two processes
never see a half-written ``libQnnHtp.so``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from qnn_mutbuf.errors import SdkNotFoundError

FORWARDER_SOURCE = Path(__file__).with_name("htp_forwarder.c")


def forwarder_stamp(build_id: str) -> str:
    """Identifies one build: the C source and the library version it fronts."""
    digest = hashlib.sha256(FORWARDER_SOURCE.read_bytes()).hexdigest()
    return f"{digest} {build_id}\n"


def find_c_compiler() -> str:
    """$CC, else cc, gcc or clang on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    raise SdkNotFoundError(
        "No C compiler found (tried "
        + ", ".join(candidates)
        + "). qnn_mutbuf compiles a small forwarding libQnnHtp.so for QAIRT >= 2.47 host "
        "libraries on first use: install one (`apt-get install gcc`) or set CC."
    )


def build_forwarder(source: Path, destination: Path) -> None:
    compiler = find_c_compiler()
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.{threading.get_ident()}")
    command = [
        compiler,
        "-O2",
        "-shared",
        "-fPIC",
        "-Wall",
        "-o",
        str(temporary),
        str(source),
        "-Wl,-soname,libQnnHtp.so",
        "-Wl,-z,nodelete",
        "-ldl",
        "-lpthread",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        temporary.unlink(missing_ok=True)
        raise SdkNotFoundError(
            f"Building the QNN forwarder with {compiler} failed (exit {result.returncode}):\n"
            f"{result.stderr.strip()[-2000:]}\nCommand: {' '.join(command)}"
        )
    os.replace(temporary, destination)
