"""One encoding per quantized mutable buffer: the state encoding.

The same memory is read again next step, so the buffer read at the start of a step,
every value stored back into it during the step and the final write-back must share
one encoding. Annotators mark state edges and outputs with a
:class:`StateQuantizationSpec`; :func:`finalize_state_specs` then puts the real spec on
the first of them in the order ``prepare_pt2e`` visits (it can only share with an
observer it has already created) and makes every other one share it. The observer is
a min-max observer: it sees the initial contents and every state calibration
produces, and never forgets a range (a moving average would clip a cache of ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e import MinMaxObserver
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

from qnn_mutbuf.observers import HeadroomMinMaxObserver, is_16bit
from qnn_mutbuf.passes.functionalize import STATE_META_KEY

ENCODING_KEY = "encoding"


@dataclass(eq=False)
class StateEncoding:
    """The shared encoding of one buffer and the nodes that carry it.

    `anchor` is the edge or node that owns the observer once finalized.
    """

    buffer: str
    first_write: Node
    qspec: QuantizationSpec
    members: list[Node] = field(default_factory=list)
    anchor: object = None

    @property
    def shared(self) -> StateQuantizationSpec:
        return StateQuantizationSpec(self)


@dataclass(eq=False)
class StateQuantizationSpec(QuantizationSpecBase):
    """Marks an edge or output as carrying the state encoding of one buffer."""

    encoding: StateEncoding

    # Read by upstream's range helpers before the markers are finalized.
    @property
    def dtype(self) -> torch.dtype:
        return self.encoding.qspec.dtype

    @property
    def quant_min(self) -> int | None:
        return self.encoding.qspec.quant_min

    @property
    def quant_max(self) -> int | None:
        return self.encoding.qspec.quant_max


def is_float_value(node: object) -> bool:
    if not isinstance(node, Node):
        return False
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )


def state_info(node: Node) -> dict | None:
    """The functionalization tag of a node: buffer, role and (while annotating) encoding."""
    return node.meta.get(STATE_META_KEY)


def with_observer(activation: QuantizationSpec, observer: type) -> QuantizationSpec:
    """The config's activation spec observed by `observer` instead; the config
    observer's ``eps`` carries over."""
    keywords = {}
    partial = getattr(activation.observer_or_fake_quant_ctr, "p", None)
    if partial is not None and "eps" in partial.keywords:
        keywords["eps"] = partial.keywords["eps"]
    return QuantizationSpec(
        dtype=activation.dtype,
        quant_min=activation.quant_min,
        quant_max=activation.quant_max,
        qscheme=activation.qscheme,
        ch_axis=activation.ch_axis,
        is_dynamic=False,
        observer_or_fake_quant_ctr=observer.with_args(**keywords),
    )


def state_qspec(activation: QuantizationSpec) -> QuantizationSpec:
    """The activation spec of the config, observed by a min-max observer."""
    if is_16bit(activation.dtype, activation.quant_min, activation.quant_max):
        # Clipped state is wrong at every later step; 16 bits leave room for headroom.
        return with_observer(activation, HeadroomMinMaxObserver)
    return with_observer(activation, MinMaxObserver)


def plan_state_encodings(
    graph_module: GraphModule, config_for: Callable[[Node], object]
) -> dict[str, StateEncoding]:
    """Picks the spec of every floating-point mutable buffer.

    `config_for(node)` returns the quantizer's QuantizationConfig for a node (or None
    when the node is left in floating point); the first write's config decides.
    Integer buffers (positions, counters) get no encoding: they stay integers.
    """
    members: dict[str, list[Node]] = {}
    for node in graph_module.graph.nodes:
        info = state_info(node)
        if info is not None and info["role"] in ("read", "write"):
            members.setdefault(info["buffer"], []).append(node)
    plan: dict[str, StateEncoding] = {}
    for buffer, nodes in members.items():
        writes = [n for n in nodes if state_info(n)["role"] == "write" and is_float_value(n)]
        if not writes:
            continue
        config = config_for(writes[0])
        activation = getattr(config, "output_activation", None)
        if activation is None:
            continue
        encoding = StateEncoding(buffer, writes[0], state_qspec(activation), nodes)
        for node in nodes:
            state_info(node)[ENCODING_KEY] = encoding
        plan[buffer] = encoding
    return plan


def encoding_of(node: object) -> StateEncoding | None:
    """The state encoding a node carries, if it is a read or write of a buffer."""
    if not isinstance(node, Node):
        return None
    info = state_info(node)
    if info is None:
        return None
    return info.get(ENCODING_KEY)


def output_spec(node: Node, encoding: StateEncoding) -> StateQuantizationSpec:
    return encoding.shared


def annotate(node: Node, input_qspec_map: dict, output_qspec: object) -> None:
    node.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(
        input_qspec_map=input_qspec_map, output_qspec=output_qspec, _annotated=True
    )


def share_reader_edges(graph_module: GraphModule, plan: dict[str, StateEncoding]) -> None:
    """Readers of a state value take it in the state encoding, not a second one.

    Upstream annotators give each input its own activation observer; on an edge that
    carries the state that would add a requantization (and a second encoding of the
    same values). Plain activation specs on such edges are replaced by the shared
    state spec; weight, derived and fixed specs are left alone.
    """
    for encoding in plan.values():
        for member in encoding.members:
            for user in list(member.users):
                if encoding_of(user) is not None:
                    continue  # writes are annotated by their own annotator
                annotation = user.meta.get(Q_ANNOTATION_KEY)
                if annotation is None or member not in annotation.input_qspec_map:
                    continue
                spec = annotation.input_qspec_map[member]
                if (
                    type(spec) is QuantizationSpec
                    and spec.dtype == encoding.qspec.dtype
                    and spec.qscheme in (torch.per_tensor_affine, torch.per_tensor_symmetric)
                ):
                    annotation.input_qspec_map[member] = encoding.shared


def finalize_state_specs(graph_module: GraphModule) -> None:
    """Replaces state markers by the real spec (first use) and shares (all others).

    Visits annotations in the order prepare_pt2e does: nodes in graph order, each
    node's input edges in map order, then its output.
    """

    def resolve(spec: object, edge_or_node: object) -> object:
        if not isinstance(spec, StateQuantizationSpec):
            return spec
        encoding = spec.encoding
        if encoding.anchor is None:
            encoding.anchor = edge_or_node
            return encoding.qspec
        return SharedQuantizationSpec(encoding.anchor)

    for node in graph_module.graph.nodes:
        info = state_info(node)
        if info is not None:
            info.pop(ENCODING_KEY, None)  # meta gets deep-copied later; keep it plain
        annotation = node.meta.get(Q_ANNOTATION_KEY)
        if annotation is None:
            continue
        for arg, spec in list(annotation.input_qspec_map.items()):
            annotation.input_qspec_map[arg] = resolve(spec, (arg, node))
        annotation.output_qspec = resolve(annotation.output_qspec, node)


def scatter_annotator(upstream_rule: object, value_argument: int):
    """The annotate function of a scatter into state (index_put, index_copy).

    On a floating-point mutable buffer the buffer input stays unannotated (an
    observer there would be a second, wrong encoding of the same memory) and the
    written values and the result take the state encoding, so the scatter on the HTP
    is a pure copy. An integer scatter (a ring cache's ``cache_positions``) is not
    quantized at all: upstream's rule would quantize int64 positions and the
    reference then fails ("Expecting input to have dtype torch.float32"). Anything
    else (a clone, an input) keeps upstream's rule.
    """

    def annotate_scatter(node: Node, quantization_config: object) -> None:
        if not is_float_value(node):
            return
        encoding = encoding_of(node)
        if encoding is None:
            upstream_rule.annotate(node, quantization_config)
            return
        value = node.args[value_argument]
        inputs = {value: encoding.shared} if is_float_value(value) else {}
        annotate(node, inputs, output_spec(node, encoding))

    return annotate_scatter
