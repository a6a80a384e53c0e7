"""QNN builder for clamps whose output encoding reaches beyond the clamp bounds.

The HTP runs a quantized ReluMinMax by clipping to its *output encoding*, not to
its min/max parameters (measured, QAIRT 2.51): ``clamp(x, 0, 0.8)`` with an output
encoding over [0, 0.98] returns 0.98. That happens whenever the encoding is wider
than the bounds: observers always include zero (``clamp(x, 0.25, 1.5)``), 16-bit
ranges have headroom, and above all a clamp that writes state
(``s.add_(x).clamp_(0, 0.8)``) shares the state encoding, which also covers the
unclamped sum, so the HTP never clamped at all.

Such a clamp is built on *windows*: encodings with the output's own scale whose
range starts (or ends) at the bound. ReluMinMax quantizes into the first window,
Converts move between windows and finally to the output encoding; with one scale
they only shift integers and saturate, so there is one rounding, as in
``round(clamp(x, low, high) / scale)``. Clamps whose encoding fits the bounds are
upstream's ReluMinMax, unchanged.
"""

from __future__ import annotations

import copy
from itertools import pairwise

import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as PyQnnManager
import numpy as np
import torch
from executorch.backends.qualcomm.builders.qnn_constants import (
    QNN_OP_PACKAGE_NAME_QTI_AISW,
    OpConvert,
    OpReluMinMax,
)
from executorch.backends.qualcomm.utils.constants import (
    QCOM_DATA,
    QCOM_OFFSET,
    QCOM_QUANT_ATTRS,
    QCOM_QUANT_MAX,
    QCOM_QUANT_MIN,
    QCOM_SCALE,
    QCOM_ZERO_POINT,
)

from qnn_mutbuf.builders.wrapping import register_wrapped_visitors

NATIVE = PyQnnManager.Qnn_TensorType_t.QNN_TENSOR_TYPE_NATIVE
FLOAT_32 = PyQnnManager.Qnn_DataType_t.QNN_DATATYPE_FLOAT_32
SCALE_OFFSET = PyQnnManager.Qnn_QuantizationEncoding_t.QNN_QUANTIZATION_ENCODING_SCALE_OFFSET

TARGETS = {
    # target: (index of the min argument, index of the max argument, defaults)
    "aten.clamp.default": (1, 2, (None, None)),
    "aten.hardtanh.default": (1, 2, (-1.0, 1.0)),
}


def clamp_bounds(node: torch.fx.Node) -> tuple[float | None, float | None]:
    low_index, high_index, (low, high) = TARGETS[node.target.__name__]
    if len(node.args) > low_index and node.args[low_index] is not None:
        low = float(node.args[low_index])
    if len(node.args) > high_index and node.args[high_index] is not None:
        high = float(node.args[high_index])
    return low, high


def clip_windows(quant_attrs: dict, low: float | None, high: float | None) -> list[int]:
    """Zero points of the same-scale windows that apply the bounds the output
    encoding does not: [] when it already stays within them."""
    if not isinstance(quant_attrs.get(QCOM_SCALE), float | int):
        return []  # per-channel or block encodings: leave them to upstream
    scale, zero_point = float(quant_attrs[QCOM_SCALE]), int(quant_attrs[QCOM_ZERO_POINT])
    quant_min, quant_max = int(quant_attrs[QCOM_QUANT_MIN]), int(quant_attrs[QCOM_QUANT_MAX])
    windows = []
    if low is not None and round(low / scale) > quant_min - zero_point:
        windows.append(quant_min - round(low / scale))  # starts at the low bound
    if high is not None and round(high / scale) < quant_max - zero_point:
        windows.append(quant_max - round(high / scale))  # ends at the high bound
    return windows


def _bounded(upstream: type) -> type:
    class BoundedClamp(upstream):
        target = list(upstream.target)

        def define_node(self, node, nodes_to_wrappers):
            quant_attrs = node.meta.get(QCOM_QUANT_ATTRS)
            low, high = clamp_bounds(node)
            windows = clip_windows(quant_attrs, low, high) if quant_attrs else []
            if not windows:
                return super().define_node(node, nodes_to_wrappers)
            input_node = self.get_node(node.args[0])
            input_wrapper = self.define_tensor(
                input_node,
                node,
                self.get_tensor(input_node, node),
                NATIVE,
                nodes_to_wrappers,
            )
            output_tensor = self.get_tensor(node, node)
            output_wrapper = self.define_tensor(
                node, node, output_tensor, NATIVE, nodes_to_wrappers
            )
            _, output_config = self.get_quant_encoding_conf(node, node)
            window_wrappers = []
            for index, zero_point in enumerate(windows):
                config = copy.copy(output_config)
                config[QCOM_OFFSET] = -zero_point
                window_wrappers.append(
                    self.define_custom_tensor_wrapper(
                        node_name=f"{node.name}_window_{index}",
                        tensor_type=NATIVE,
                        dtype=self.get_data_type(output_tensor, config),
                        quant_encoding=SCALE_OFFSET,
                        quant_configs=config,
                        dims=output_tensor.size(),
                        tensor=output_tensor,
                        is_fake_tensor=True,
                        nodes_to_wrappers=nodes_to_wrappers,
                    )
                )
            relu = PyQnnManager.PyQnnOpWrapper(
                node.name, QNN_OP_PACKAGE_NAME_QTI_AISW, OpReluMinMax.op_name
            )
            relu.AddInputTensors([input_wrapper])
            relu.AddOutputTensors([window_wrappers[0]])
            finfo = torch.finfo(torch.float32)
            for name, value in (
                (OpReluMinMax.param_max_value, finfo.max if high is None else high),
                (OpReluMinMax.param_min_value, finfo.min if low is None else low),
            ):
                relu.AddScalarParam(name, FLOAT_32, {QCOM_DATA: np.float32(value)})
            ops = [relu]
            chain = [*window_wrappers, output_wrapper]
            for index, (source, target) in enumerate(pairwise(chain)):
                convert = PyQnnManager.PyQnnOpWrapper(
                    f"{node.name}_convert_{index}", QNN_OP_PACKAGE_NAME_QTI_AISW, OpConvert.op_name
                )
                convert.AddInputTensors([source])
                convert.AddOutputTensors([target])
                ops.append(convert)
            return ops

    return BoundedClamp


def register_bounded_clamp_visitors() -> None:
    register_wrapped_visitors(TARGETS, "Bounded", _bounded)
