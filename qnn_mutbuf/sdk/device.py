"""Checks that the host simulator can create an HTP device for a SoC.

A device created without the right custom configs silently falls back to HTP arch
68, where v73+ ops fail validation; creating the device explicitly, with the SoC's
configs, is the cheapest proof that the toolchain works.
"""

from __future__ import annotations

from qnn_mutbuf.errors import SdkNotFoundError
from qnn_mutbuf.sdk.activation import activate_host_sdk


def htp_compile_spec(
    soc: str = "SM8650", fp16: bool = False, from_context_binary: bool = False
) -> list:
    """ExecuTorch compile specs for the HTP of `soc`."""
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    from qnn_mutbuf.soc import resolve_soc

    return generate_qnn_executorch_compiler_spec(
        soc_model=resolve_soc(soc),
        backend_options=generate_htp_compiler_spec(use_fp16=fp16),
        is_from_context_binary=from_context_binary,
    )


def check_htp_device(soc: str = "SM8650") -> None:
    """Creates (and frees) a QNN HTP backend and device for `soc` on the host."""
    activate_host_sdk()
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as adaptor

    specs = htp_compile_spec(soc)
    manager = adaptor.QnnManager(specs[0].value)
    try:
        status = manager.InitBackend()
    finally:
        manager.Destroy()
    if status != adaptor.Error.Ok:
        raise SdkNotFoundError(
            f"The QNN host libraries could not create an HTP device for {soc} ({status}). "
            "Run with QNN_MUTBUF_FORWARDER_LOG=1 to see the device configs passed to QNN."
        )
