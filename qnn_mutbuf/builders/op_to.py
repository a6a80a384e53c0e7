"""QNN builder for casts of integers (positions) into the quantized domain.

``pos.float()`` followed by a quantize folds into one QNN Cast from INT32 to a
fixed-point type, and the HTP reads that as a raw code: position 2 becomes
``2 * scale``, so rotary embeddings see position ~0 at every step (keys written into
a KV cache unrotated). We build it as Cast to FLOAT_32, then Quantize: the value is
converted, then encoded. Every other cast is upstream's visitor, unchanged.
"""

from __future__ import annotations

import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as PyQnnManager
import torch
from executorch.backends.qualcomm.builders.qnn_constants import (
    QNN_OP_PACKAGE_NAME_QTI_AISW,
    OpCast,
    OpQuantize,
)
from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS

from qnn_mutbuf.builders.wrapping import register_wrapped_visitors

NATIVE = PyQnnManager.Qnn_TensorType_t.QNN_TENSOR_TYPE_NATIVE
FLOAT_32 = PyQnnManager.Qnn_DataType_t.QNN_DATATYPE_FLOAT_32
UNDEFINED = PyQnnManager.Qnn_QuantizationEncoding_t.QNN_QUANTIZATION_ENCODING_UNDEFINED


def _is_integer(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and value.dtype != torch.bool
        and QCOM_QUANT_ATTRS not in node.meta
    )


TARGETS = ["aten._to_copy.default", "dim_order_ops._to_dim_order_copy.default"]


def _integer_to_quantized(upstream: type) -> type:
    class IntegerToQuantizedCast(upstream):
        target = list(upstream.target)

        def define_node(self, node, nodes_to_wrappers):
            source = self.get_node(node.args[0])
            if not (_is_integer(source) and node.meta.get(QCOM_QUANT_ATTRS)):
                return super().define_node(node, nodes_to_wrappers)
            source_tensor = self.get_tensor(source, node)
            source_wrapper = self.define_tensor(
                source, node, source_tensor, NATIVE, nodes_to_wrappers
            )
            as_float = self.define_custom_tensor_wrapper(
                node_name=node.name + "_as_float",
                tensor_type=NATIVE,
                dtype=FLOAT_32,
                quant_encoding=UNDEFINED,
                quant_configs={},
                dims=source_tensor.size(),
                tensor=source_tensor.to(torch.float32),
                is_fake_tensor=True,
                nodes_to_wrappers=nodes_to_wrappers,
            )
            cast = PyQnnManager.PyQnnOpWrapper(
                node.name + "_as_float", QNN_OP_PACKAGE_NAME_QTI_AISW, OpCast.op_name
            )
            cast.AddInputTensors([source_wrapper])
            cast.AddOutputTensors([as_float])
            output_tensor = self.get_tensor(node, node)
            output_wrapper = self.define_tensor(
                node, node, output_tensor, NATIVE, nodes_to_wrappers
            )
            quantize = PyQnnManager.PyQnnOpWrapper(
                node.name, QNN_OP_PACKAGE_NAME_QTI_AISW, OpQuantize.op_name
            )
            quantize.AddInputTensors([as_float])
            quantize.AddOutputTensors([output_wrapper])
            return [cast, quantize]

    return IntegerToQuantizedCast


def register_integer_cast_visitors() -> None:
    register_wrapped_visitors(TARGETS, "IntegerCast", _integer_to_quantized)
