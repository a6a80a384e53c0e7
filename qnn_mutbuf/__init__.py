"""qnn_mutbuf: mutable buffers (KV caches, running state) on ExecuTorch's QNN HTP backend.

Public API, loaded lazily so that ``import qnn_mutbuf`` loads no QNN library:

* :class:`MutableBufferQnnQuantizer` - drop-in for ``QnnQuantizer`` in PT2E;
* :func:`find_mutable_buffers` - which buffers a graph mutates, and where;
* :func:`reset_state` - a convert_pt2e module back at its initial state (the reference);
* :func:`quantize` / :func:`lower` - the driver from nn.Module to ExecuTorch program;
* :func:`diagnose` - the first op and step where the HTP departs from fake-quant;
* :class:`HostRunner`, :class:`AdbRunner`, :class:`AiHubRunner` - run a `.pte` step by step.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "MutableBufferQnnQuantizer": "qnn_mutbuf.quantizer",
    "find_mutable_buffers": "qnn_mutbuf.detect",
    "reset_state": "qnn_mutbuf.records",
    "quantize": "qnn_mutbuf.lowering",
    "lower": "qnn_mutbuf.lowering",
    "HostRunner": "qnn_mutbuf.runners.host",
    "AdbRunner": "qnn_mutbuf.runners.adb",
    "AiHubRunner": "qnn_mutbuf.runners.aihub",
    "host_sdk_info": "qnn_mutbuf.sdk.activation",
    "diagnose": "qnn_mutbuf.diagnosis",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qnn_mutbuf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
