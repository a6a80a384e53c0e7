"""Shared pytest setup: quiet progress bars, the slow marker, the host SDK fixture."""

import os

os.environ.setdefault("QNN_MUTBUF_PROGRESS", "0")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if os.environ.get("QNN_MUTBUF_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set QNN_MUTBUF_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def host_sdk():
    from qnn_mutbuf.sdk import activate_host_sdk

    return activate_host_sdk()
