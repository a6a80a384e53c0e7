"""Make the QNN host libraries usable by ExecuTorch in this process, once.

ExecuTorch's QNN adaptor dlopen()s ``libQnnHtp.so`` and ``libQnnSystem.so`` by name
when a backend starts. We stage the host libraries in a per-version cache folder
(with the device-config forwarder standing in for ``libQnnHtp.so`` when the library
is QAIRT >= 2.47), point ``QNN_SDK_ROOT`` at it and load both libraries by absolute
path, so that the by-name dlopen finds them by soname. No LD_LIBRARY_PATH needed.

Importing this module loads nothing; :func:`activate_host_sdk` does the work.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from qnn_mutbuf.errors import SdkNotFoundError
from qnn_mutbuf.sdk.forwarder import FORWARDER_SOURCE, build_forwarder, forwarder_stamp

logger = logging.getLogger(__name__)

HOST_LIB_SUBDIR = Path("lib") / "x86_64-linux-clang"
STAGE_MARKER = ".qnn_mutbuf_stage.json"
REAL_HTP_NAME = "libQnnHtp.real.so"
# QAIRT 2.47 moved the union of an HTP device custom config from byte 4 to byte 8.
FORWARDER_MIN_VERSION = (2, 47)
_BUILD_ID_PATTERN = re.compile(rb"v(\d+)\.(\d+)\.(\d+)\.(\d{6,})")


@dataclass(frozen=True)
class HostSdkInfo:
    """What :func:`activate_host_sdk` found and set up."""

    qairt_build_id: str
    qairt_version: tuple[int, int, int]
    htp_api_version: str
    core_api_version: str
    library_dir: Path
    sdk_root: Path
    source_dir: Path
    source: str
    original_sdk_root: Path | None
    forwarder: bool

    @property
    def qairt_version_text(self) -> str:
        return ".".join(str(part) for part in self.qairt_version)


@dataclass(frozen=True)
class _LibrarySource:
    lib_dir: Path
    extra_dirs: tuple[Path, ...]
    origin: str
    original_sdk_root: Path | None


_lock = threading.Lock()
_info: HostSdkInfo | None = None
_handles: list[ctypes.CDLL] = []


def activate_host_sdk() -> HostSdkInfo:
    """Stage and preload the QNN host libraries; idempotent and thread-safe.

    Raises :class:`SdkNotFoundError` with one message naming the setting, file or
    tool at fault when the libraries cannot be found, built or loaded.
    """
    global _info
    if _info is not None:
        return _info
    with _lock:
        if _info is None:
            _info = _activate()
    return _info


def host_sdk_info() -> HostSdkInfo:
    """The QAIRT build id, HTP API version, library folder and forwarder status."""
    return activate_host_sdk()


def cache_root() -> Path:
    """Where staged library folders live: $QNN_MUTBUF_CACHE, else the XDG cache."""
    if override := os.environ.get("QNN_MUTBUF_CACHE"):
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "qnn_mutbuf"


def _activate() -> HostSdkInfo:
    # Qualcomm's libraries bring their own libc++; loading them before torch and
    # executorch crashes the process ("libc++abi: Pure virtual function called!").
    import executorch  # noqa: F401
    import torch  # noqa: F401

    source = _find_source()
    build_id, version = read_build_id(source.lib_dir / "libQnnHtp.so")
    use_forwarder = version[:2] >= FORWARDER_MIN_VERSION
    stage_root = _stage(source, build_id, use_forwarder)
    lib_dir = stage_root / HOST_LIB_SUBDIR
    os.environ["QNN_SDK_ROOT"] = str(stage_root)
    _preload(lib_dir, use_forwarder)
    core_api, htp_api = _read_api_versions(lib_dir / "libQnnHtp.so")
    info = HostSdkInfo(
        qairt_build_id=_live_build_id(lib_dir / "libQnnHtp.so") or build_id,
        qairt_version=version,
        htp_api_version=htp_api,
        core_api_version=core_api,
        library_dir=lib_dir,
        sdk_root=stage_root,
        source_dir=source.lib_dir,
        source=source.origin,
        original_sdk_root=source.original_sdk_root,
        forwarder=use_forwarder,
    )
    logger.info(
        "QNN host SDK %s (HTP API %s) staged at %s%s",
        info.qairt_build_id,
        htp_api,
        lib_dir,
        " with the device-config forwarder" if use_forwarder else "",
    )
    return info


def _is_linux_x86_64() -> bool:
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def _find_source() -> _LibrarySource:
    root_setting = os.environ.get("QNN_SDK_ROOT", "")
    if root_setting:
        root = Path(root_setting).expanduser()
        marker = root / STAGE_MARKER
        if marker.is_file():
            # A child process inherits the QNN_SDK_ROOT we set: go back to the source.
            recorded = json.loads(marker.read_text())
            original = recorded.get("original_sdk_root")
            return _LibrarySource(
                lib_dir=Path(recorded["source_dir"]),
                extra_dirs=tuple(Path(p) for p in recorded.get("extra_dirs", [])),
                origin=recorded.get("origin", "QNN_SDK_ROOT"),
                original_sdk_root=Path(original) if original else None,
            )
        lib_dir = root / HOST_LIB_SUBDIR
        for name in ("libQnnHtp.so", "libQnnSystem.so"):
            if not (lib_dir / name).is_file():
                raise SdkNotFoundError(
                    f"QNN_SDK_ROOT={root} has no {HOST_LIB_SUBDIR / name}. Point QNN_SDK_ROOT "
                    "at a QAIRT SDK (the folder that holds lib/ and bin/), or unset it to use "
                    "the host libraries shipped in the onnxruntime-qnn package."
                )
        return _LibrarySource(lib_dir, (), "QNN_SDK_ROOT", root)

    if not _is_linux_x86_64():
        raise SdkNotFoundError(
            f"The QNN host simulator needs Linux x86_64 host libraries; this host is "
            f"{platform.system()} {platform.machine()}. Set QNN_SDK_ROOT to a QAIRT SDK with "
            "lib/x86_64-linux-clang, or run on a phone with `qnn-mutbuf run adb` or on "
            "Qualcomm AI Hub with `qnn-mutbuf run aihub`."
        )
    spec = importlib.util.find_spec("onnxruntime_qnn")
    if spec is None or not spec.submodule_search_locations:
        raise SdkNotFoundError(
            "No QNN host libraries: QNN_SDK_ROOT is not set and the onnxruntime-qnn package "
            "is not installed. Run `pip install onnxruntime-qnn==2.7.0` or set QNN_SDK_ROOT "
            "to a QAIRT SDK."
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    for name in ("libQnnHtp.so", "libQnnSystem.so"):
        if not (package_dir / name).is_file():
            raise SdkNotFoundError(
                f"The onnxruntime-qnn package at {package_dir} has no {name}. Reinstall it with "
                "`pip install --force-reinstall onnxruntime-qnn==2.7.0` or set QNN_SDK_ROOT."
            )
    bundled = package_dir.parent / "onnxruntime_qnn.libs"
    extra = (bundled,) if bundled.is_dir() else ()
    return _LibrarySource(package_dir, extra, "onnxruntime-qnn", None)


def read_build_id(library: Path) -> tuple[str, tuple[int, int, int]]:
    """The QAIRT build id embedded in a libQnnHtp.so, read without loading it.

    Loading the real library to ask it would put a second object with soname
    libQnnHtp.so in the process, ahead of the forwarder.
    """
    stat = library.stat()
    cache_file = cache_root() / "build_ids.json"
    key = f"{library.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        build_id = known[key]
    else:
        match = None
        overlap = b""
        with open(library, "rb") as handle:
            while chunk := handle.read(1 << 22):
                match = _BUILD_ID_PATTERN.search(overlap + chunk)
                if match:
                    break
                overlap = chunk[-64:]
        if match is None:
            raise SdkNotFoundError(
                f"{library} carries no QAIRT build id (v2.x.y.z); it does not look like a "
                "QNN HTP library. Point QNN_SDK_ROOT at a QAIRT SDK."
            )
        build_id = match.group(0).decode()
        known[key] = build_id
        _write_atomically(cache_file, json.dumps(known, indent=1))
    numbers = _BUILD_ID_PATTERN.match(build_id.encode())
    version = tuple(int(numbers.group(i)) for i in (1, 2, 3))
    return build_id, version  # type: ignore[return-value]


def _stage(source: _LibrarySource, build_id: str, use_forwarder: bool) -> Path:
    digest = hashlib.sha256(str(source.lib_dir.resolve()).encode()).hexdigest()[:10]
    stage_root = cache_root() / f"qairt-{build_id.lstrip('v')}-{digest}"
    lib_dir = stage_root / HOST_LIB_SUBDIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, Path] = {}
    for folder in (source.lib_dir, *source.extra_dirs):
        for path in sorted(folder.iterdir()):
            if path.is_file() and ".so" in path.name:
                wanted.setdefault(path.name, path)
    if use_forwarder:
        wanted[REAL_HTP_NAME] = wanted.pop("libQnnHtp.so")
    for name, target in wanted.items():
        _link(lib_dir / name, target)
    if use_forwarder:
        stamp = forwarder_stamp(build_id)
        stamp_file = lib_dir / ".forwarder.stamp"
        forwarder = lib_dir / "libQnnHtp.so"
        current = stamp_file.read_text() if stamp_file.is_file() else ""
        if current != stamp or not forwarder.is_file() or forwarder.is_symlink():
            build_forwarder(FORWARDER_SOURCE, forwarder)
            _write_atomically(stamp_file, stamp)
    else:
        _link(lib_dir / "libQnnHtp.so", wanted["libQnnHtp.so"])
    marker = {
        "source_dir": str(source.lib_dir),
        "extra_dirs": [str(p) for p in source.extra_dirs],
        "origin": source.origin,
        "original_sdk_root": str(source.original_sdk_root) if source.original_sdk_root else None,
        "build_id": build_id,
        "forwarder": use_forwarder,
    }
    _write_atomically(stage_root / STAGE_MARKER, json.dumps(marker, indent=1))
    return stage_root


def _link(link: Path, target: Path) -> None:
    """Points `link` at `target`, replacing atomically so readers never see a gap."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    temporary = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}")
    if temporary.is_symlink() or temporary.exists():
        temporary.unlink()
    os.symlink(target, temporary)
    os.replace(temporary, link)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def _preload(lib_dir: Path, use_forwarder: bool) -> None:
    for name in ("libQnnHtp.so", "libQnnSystem.so"):
        path = lib_dir / name
        try:
            _handles.append(ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL))
        except OSError as error:
            raise SdkNotFoundError(
                f"Cannot load {path} (from {path.resolve()}): {error}. Check that the QAIRT host "
                "libraries match this machine, or set QNN_SDK_ROOT to another SDK."
            ) from error
    if use_forwarder:
        # The by-name lookup ExecuTorch does must land on the forwarder, not on a real
        # libQnnHtp.so that something loaded earlier in this process.
        by_name = ctypes.CDLL("libQnnHtp.so", mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        if not hasattr(by_name, "QnnMutbufForwarder_version"):
            raise SdkNotFoundError(
                "Another libQnnHtp.so was loaded into this process before qnn_mutbuf activated "
                "its host libraries, so ExecuTorch would bypass the QAIRT >= 2.47 device-config "
                "fix. Import qnn_mutbuf and lower or run before loading other QNN libraries "
                "(for example onnxruntime's QNN execution provider)."
            )


class _ApiVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("patch", ctypes.c_uint32)]


class _ProviderHeader(ctypes.Structure):
    # {u32 backendId; const char* providerName; u32 core[3]; u32 backend[3]; table...}
    _fields_ = [
        ("backend_id", ctypes.c_uint32),
        ("provider_name", ctypes.c_char_p),
        ("core", _ApiVersion),
        ("backend", _ApiVersion),
    ]


def _read_api_versions(library: Path) -> tuple[str, str]:
    handle = ctypes.CDLL(str(library), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    providers = ctypes.POINTER(ctypes.POINTER(_ProviderHeader))()
    count = ctypes.c_uint32()
    get_providers = handle.QnnInterface_getProviders
    get_providers.restype = ctypes.c_uint64
    if get_providers(ctypes.byref(providers), ctypes.byref(count)) != 0 or count.value == 0:
        raise SdkNotFoundError(f"{library} returned no QNN interface providers.")
    header = providers[0].contents

    def text(version: _ApiVersion) -> str:
        return f"{version.major}.{version.minor}.{version.patch}"

    return text(header.core), text(header.backend)


def _live_build_id(library: Path) -> str | None:
    """The build id as ExecuTorch's adaptor reads it from the loaded library."""
    try:
        import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as adaptor

        return str(adaptor.GetQnnSdkBuildId(str(library)))
    except Exception:  # reported through the file-scanned id instead
        logger.debug("GetQnnSdkBuildId failed for %s", library, exc_info=True)
        return None


def activate_for_quantization() -> HostSdkInfo | None:
    """Activates the host SDK when it can; quantizing alone needs no SDK.

    ExecuTorch's QnnQuantizer otherwise tries to download a QAIRT SDK from the
    network when QNN_SDK_ROOT is unset. Where no host SDK is usable (a Mac, say),
    QNN_SDK_ROOT is set empty, which tells ExecuTorch the SDK is the caller's business.
    """
    try:
        return activate_host_sdk()
    except SdkNotFoundError as error:
        logger.warning("QNN host SDK not activated (%s); quantizing without it.", error)
        os.environ.setdefault("QNN_SDK_ROOT", "")
        return None
