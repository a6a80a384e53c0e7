"""Host QNN SDK activation: stage, fix up and preload the QAIRT host libraries."""

from qnn_mutbuf.sdk.activation import HostSdkInfo, activate_host_sdk, cache_root, host_sdk_info

__all__ = ["HostSdkInfo", "activate_host_sdk", "cache_root", "host_sdk_info"]
