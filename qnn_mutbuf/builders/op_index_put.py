"""QNN builder for ``index_put`` that writes mutable buffers in their state encoding.

Replaces upstream's visitor for ``aten.index_put.default``:

* on a mutable buffer (or a value derived from one) the buffer tensor gets the quant
  attrs of the node output, so the state read and the state written carry identical
  encodings; if the buffer already carries a different encoding that is an error,
  not a silent reinterpretation of the memory;
* the ScatterNd is built for every placement of ``None`` in the index list. Upstream
  assumes the written values follow the buffer's dimension order, which is false
  when PyTorch moves non-adjacent advanced indices to the front
  (``cache[p0, :, p1] = v``, "IndexPut mode 5"), where it builds a zero-sized tile;
* ``index_put`` on anything else with adjacent indices is built by upstream's
  visitor, unchanged.
"""

from __future__ import annotations

import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as PyQnnManager
import numpy as np
import torch
from executorch.backends.qualcomm.builders.node_visitor import (
    QNN_QUANT_TYPE_MAP,
    QNN_TENSOR_TYPE_MAP,
)
from executorch.backends.qualcomm.builders.qnn_constants import (
    QNN_OP_PACKAGE_NAME_QTI_AISW,
    OpConcat,
    OpReshape,
    OpScatterNd,
    OpTile,
)
from executorch.backends.qualcomm.utils.constants import (
    QCOM_AXIS_ORDER,
    QCOM_DATA,
    QCOM_DTYPE,
    QCOM_QUANT_ATTRS,
)
from executorch.exir.dialects._ops import ops as exir_ops

from qnn_mutbuf.builders.state_encoding import give_state_encoding, is_state_tensor
from qnn_mutbuf.builders.wrapping import register_wrapped_visitors
from qnn_mutbuf.errors import LoweringError

NATIVE = PyQnnManager.Qnn_TensorType_t.QNN_TENSOR_TYPE_NATIVE
STATIC = PyQnnManager.Qnn_TensorType_t.QNN_TENSOR_TYPE_STATIC
UNDEFINED = PyQnnManager.Qnn_QuantizationEncoding_t.QNN_QUANTIZATION_ENCODING_UNDEFINED
UINT_32 = PyQnnManager.Qnn_DataType_t.QNN_DATATYPE_UINT_32


def _index_list(node: torch.fx.Node) -> list:
    indices = node.args[1]
    return list(indices) if isinstance(indices, (list, tuple)) else [indices]


def _specified(indices: list) -> list[int]:
    return [dim for dim, index in enumerate(indices) if index is not None]


def needs_own_builder(node: torch.fx.Node, edge_program) -> bool:
    indices = _index_list(node)
    specified = _specified(indices)
    adjacent = bool(specified) and specified == list(range(specified[0], specified[-1] + 1))
    return not adjacent or is_state_tensor(node.args[0], edge_program)


def _state_index_put(upstream: type) -> type:
    class StateIndexPut(upstream):
        target = list(upstream.target)

        def define_node(
            self,
            node: torch.fx.Node,
            nodes_to_wrappers: dict[torch.fx.Node, PyQnnManager.TensorWrapper],
        ):
            if not needs_own_builder(node, self.edge_program):
                return super().define_node(node, nodes_to_wrappers)
            data_node = self.get_node(node.args[0])
            give_state_encoding(data_node, node, self.edge_program)
            if QCOM_AXIS_ORDER in node.meta or QCOM_AXIS_ORDER in data_node.meta:
                raise LoweringError(
                    f"index_put node '{node.name}' writes a tensor whose layout the QNN layout "
                    "pass changed; qnn_mutbuf cannot build that scatter."
                )
            return _ScatterBuilder(self, node, data_node, nodes_to_wrappers).build()

    return StateIndexPut


def register_state_index_put_visitor() -> None:
    register_wrapped_visitors(["aten.index_put.default"], "State", _state_index_put)


class _ScatterBuilder:
    """Builds data/indices/updates for one QNN ScatterNd.

    With S the buffer shape and k the length of the index list, PyTorch's indexed
    result R is the update grid U followed by S[k:]; U is S[:first] + B + S[last+1:k]
    for adjacent indices and B + (non-indexed dims of S[:k]) otherwise, where B is
    the broadcast shape of the index tensors. indices[u] is the k-tuple of buffer
    coordinates of grid point u; updates are the values broadcast to R.
    """

    def __init__(self, visitor, node, data_node, nodes_to_wrappers) -> None:
        self.visitor = visitor
        self.node = node
        self.data_node = data_node
        self.wrappers = nodes_to_wrappers
        self.ops: list = []

    def build(self) -> list:
        visitor, node = self.visitor, self.node
        data_tensor = visitor.get_tensor(self.data_node, node)
        data_wrapper = visitor.define_tensor(
            self.data_node, node, data_tensor, NATIVE, self.wrappers
        )
        shape = list(data_tensor.shape)
        indices = _index_list(node)
        if len(indices) > len(shape):
            raise LoweringError(f"index_put node '{node.name}' has more indices than dims.")
        specified = _specified(indices)
        if not specified:
            raise LoweringError(f"index_put node '{node.name}' has no index tensor.")
        for dim in specified:
            if indices[dim].meta["val"].dtype == torch.bool:
                raise LoweringError(
                    f"index_put node '{node.name}' uses a boolean mask index, which the HTP "
                    "ScatterNd cannot express; use integer positions."
                )
        broadcast = list(
            torch.broadcast_shapes(*(tuple(indices[d].meta["val"].shape) for d in specified))
        )
        adjacent = specified == list(range(specified[0], specified[-1] + 1))
        count = len(indices)
        if adjacent:
            layout = (
                [("range", d) for d in range(specified[0])]
                + [("index", j) for j in range(len(broadcast))]
                + [("range", d) for d in range(specified[-1] + 1, count)]
            )
        else:
            layout = [("index", j) for j in range(len(broadcast))] + [
                ("range", d) for d in range(count) if d not in specified
            ]
        grid = [shape[d] if kind == "range" else broadcast[d] for kind, d in layout]

        components = []
        for dim in range(count):
            if indices[dim] is None:
                components.append(self._range_component(dim, shape[dim], layout, grid))
            else:
                components.append(self._index_component(dim, indices[dim], broadcast, layout, grid))
        index_wrapper = self._concat_components(components, grid, count)
        updates_wrapper = self._updates(grid + shape[count:])

        output_tensor = visitor.get_tensor(node, node)
        output_wrapper = visitor.define_tensor(node, node, output_tensor, NATIVE, self.wrappers)
        scatter = PyQnnManager.PyQnnOpWrapper(
            node.name, QNN_OP_PACKAGE_NAME_QTI_AISW, OpScatterNd.op_name
        )
        if len(node.args) > 3 and node.args[3]:
            scatter.AddScalarParam(OpScatterNd.param_reduction, UINT_32, {QCOM_DATA: 1})
        scatter.AddInputTensors([data_wrapper, index_wrapper, updates_wrapper])
        scatter.AddOutputTensors([output_wrapper])
        self.ops.append(scatter)
        return self.ops

    # --- helpers -------------------------------------------------------------------

    def _name(self, suffix: str) -> str:
        return f"{self.node.name}_{suffix}"

    def _native(self, suffix: str, dtype, encoding, configs, dims) -> object:
        return self.visitor.define_custom_tensor_wrapper(
            node_name=self._name(suffix),
            tensor_type=NATIVE,
            dtype=dtype,
            quant_encoding=encoding,
            quant_configs=configs,
            dims=torch.Size(dims),
            tensor=torch.empty(dims),
            is_fake_tensor=True,
            nodes_to_wrappers=self.wrappers,
        )

    def _op(self, suffix: str, op_name: str, inputs: list, outputs: list):
        op = PyQnnManager.PyQnnOpWrapper(self._name(suffix), QNN_OP_PACKAGE_NAME_QTI_AISW, op_name)
        op.AddInputTensors(inputs)
        op.AddOutputTensors(outputs)
        self.ops.append(op)
        return op

    def _reshape(self, suffix, source, dtype, encoding, configs, dims):
        wrapper = self._native(suffix, dtype, encoding, configs, dims)
        self._op(suffix, OpReshape.op_name, [source], [wrapper])
        return wrapper

    def _tile(self, suffix, source, dtype, encoding, configs, dims, multiples):
        if all(m == 1 for m in multiples):
            return source
        wrapper = self._native(suffix, dtype, encoding, configs, dims)
        op = self._op(suffix, OpTile.op_name, [source], [wrapper])
        op.AddTensorParam(
            OpTile.param_multiples,
            UINT_32,
            1,
            [len(multiples)],
            np.array(multiples, dtype=np.uint32),
            True,
        )
        return wrapper

    def _range_component(self, dim: int, size: int, layout, grid):
        position = layout.index(("range", dim))
        view = [size if i == position else 1 for i in range(len(grid))]
        values = torch.arange(size, dtype=torch.int32).reshape(view).expand(grid)
        values = values.contiguous().reshape(*grid, 1)
        constant = torch.fx.Node(
            self.node.graph,
            self._name(f"range_{dim}"),
            "call_function",
            exir_ops.edge.aten.tensor.default,
            (),
            {},
        )
        return self.visitor.define_tensor(constant, self.node, values, STATIC, self.wrappers)

    def _index_component(self, dim, index_node, broadcast, layout, grid):
        visitor = self.visitor
        index_tensor = visitor.get_tensor(index_node, index_node)
        wrapper = visitor.define_tensor(index_node, self.node, index_tensor, NATIVE, self.wrappers)
        dtype = QNN_TENSOR_TYPE_MAP[index_tensor.dtype]
        leading = [1] * (len(broadcast) - index_tensor.dim()) + list(index_tensor.shape)
        placed = []
        for kind, position in layout:
            placed.append(leading[position] if kind == "index" else 1)
        reshaped = self._reshape(
            f"index_{dim}_reshape", wrapper, dtype, UNDEFINED, {}, placed + [1]
        )
        multiples = [g // p for g, p in zip(grid, placed, strict=True)] + [1]
        return self._tile(
            f"index_{dim}_tile", reshaped, dtype, UNDEFINED, {}, grid + [1], multiples
        )

    def _concat_components(self, components, grid, count):
        if count == 1:
            return components[0]
        dtype = PyQnnManager.Qnn_DataType_t.QNN_DATATYPE_INT_32
        wrapper = self._native("indices", dtype, UNDEFINED, {}, grid + [count])
        op = self._op("indices", OpConcat.op_name, components, [wrapper])
        op.AddScalarParam(OpConcat.param_axis, UINT_32, {QCOM_DATA: np.uint32(len(grid))})
        return wrapper

    def _updates(self, result_shape: list[int]):
        visitor, node = self.visitor, self.node
        value_node = visitor.get_node(node.args[2])
        value_tensor = visitor.get_tensor(value_node, node)
        value_wrapper = visitor.define_tensor(value_node, node, value_tensor, NATIVE, self.wrappers)
        encoding, configs = visitor.get_quant_encoding_conf(value_node, node)
        if encoding == UNDEFINED:
            dtype = QNN_TENSOR_TYPE_MAP[value_tensor.dtype]
        else:
            stored = configs[QCOM_DTYPE]
            dtype = QNN_QUANT_TYPE_MAP[torch.uint16 if stored == torch.int32 else stored]
        if value_tensor.dim() > len(result_shape):
            raise LoweringError(
                f"index_put node '{node.name}' writes values of shape "
                f"{list(value_tensor.shape)} into a slot of shape {result_shape}."
            )
        aligned = [1] * (len(result_shape) - value_tensor.dim()) + list(value_tensor.shape)
        reshaped = self._reshape("value_reshape", value_wrapper, dtype, encoding, configs, aligned)
        multiples = [r // a for r, a in zip(result_shape, aligned, strict=True)]
        if (
            QCOM_QUANT_ATTRS in node.meta
            and encoding == UNDEFINED
            and value_tensor.is_floating_point()
        ):
            raise LoweringError(
                f"index_put node '{node.name}' is quantized but its values are not."
            )
        return self._tile("value_tile", reshaped, dtype, encoding, configs, result_shape, multiples)
