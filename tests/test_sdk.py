"""Host QNN SDK activation: staging, forwarder, errors, and an HTP device for SM8650."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from qnn_mutbuf.errors import LoweringError, SdkNotFoundError
from qnn_mutbuf.sdk import activation
from qnn_mutbuf.sdk.device import check_htp_device
from qnn_mutbuf.sdk.forwarder import find_c_compiler, forwarder_stamp


def test_activation_is_idempotent_and_thread_safe(host_sdk):
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(activation.activate_host_sdk()))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(result is host_sdk for result in results)
    assert os.environ["QNN_SDK_ROOT"] == str(host_sdk.sdk_root)
    assert (host_sdk.library_dir / "libQnnHtp.so").is_file()
    assert (host_sdk.library_dir / "libQnnSystem.so").exists()
    assert host_sdk.qairt_build_id.startswith("v2.")
    if host_sdk.qairt_version[:2] >= activation.FORWARDER_MIN_VERSION:
        assert host_sdk.forwarder
        assert (host_sdk.library_dir / activation.REAL_HTP_NAME).exists()


def test_htp_device_for_sm8650_is_created(host_sdk):
    check_htp_device("SM8650")


def test_unknown_soc_lists_the_valid_names(host_sdk):
    with pytest.raises(LoweringError, match="SM8650") as error:
        check_htp_device("SM9999")
    assert "Unknown SoC 'SM9999'" in str(error.value)


def test_import_loads_no_qnn_library():
    code = (
        "import qnn_mutbuf, qnn_mutbuf.lowering, qnn_mutbuf.runners.host\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libQnn' not in maps, 'a QNN library was loaded on import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _activate_in_subprocess(env_updates, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QNN_SDK_ROOT"}
    env.update(env_updates)
    env["QNN_MUTBUF_CACHE"] = str(tmp_path / "cache")
    code = (
        "from qnn_mutbuf.sdk import activate_host_sdk\n"
        "info = activate_host_sdk()\n"
        "print(info.qairt_build_id, info.forwarder)\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_empty_qnn_sdk_root_gives_one_clear_message(tmp_path):
    empty = tmp_path / "empty_sdk"
    empty.mkdir()
    result = _activate_in_subprocess({"QNN_SDK_ROOT": str(empty)}, tmp_path)
    assert result.returncode != 0
    assert f"QNN_SDK_ROOT={empty} has no lib/x86_64-linux-clang/libQnnHtp.so" in result.stderr


def test_fresh_cache_is_staged_and_reused(tmp_path):
    first = _activate_in_subprocess({}, tmp_path)
    assert first.returncode == 0, first.stderr
    staged = list((tmp_path / "cache").glob("qairt-*/lib/x86_64-linux-clang/libQnnHtp.so"))
    assert len(staged) == 1
    built = staged[0].stat().st_mtime_ns
    second = _activate_in_subprocess({}, tmp_path)
    assert second.returncode == 0, second.stderr
    assert staged[0].stat().st_mtime_ns == built, "forwarder rebuilt although nothing changed"


def test_non_linux_host_without_sdk_root(monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.setattr(activation.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(activation.platform, "machine", lambda: "arm64")
    with pytest.raises(SdkNotFoundError, match="needs Linux x86_64 host libraries"):
        activation._find_source()


def test_missing_c_compiler(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-qnn-mutbuf")
    with pytest.raises(SdkNotFoundError, match="No C compiler found .*no-such-compiler-qnn-mutbuf"):
        find_c_compiler()


def test_library_that_fails_to_load_reports_dlerror(tmp_path):
    (tmp_path / "libQnnHtp.so").write_bytes(b"this is not an ELF file")
    with pytest.raises(SdkNotFoundError) as error:
        activation._preload(Path(tmp_path), use_forwarder=False)
    assert "libQnnHtp.so" in str(error.value)
    assert "invalid ELF header" in str(error.value) or "file too short" in str(error.value)


def test_forwarder_stamp_follows_source_and_version():
    assert forwarder_stamp("v2.51.0.1") != forwarder_stamp("v2.52.0.1")
