"""Registering a subclass in place of an upstream node visitor, once.

Our builders extend upstream's visitors rather than copy them: each wraps the
visitor registered for a target and registers the subclass for the same target.
Each wrapper records which wrappings it carries, so registering twice (a module
reloaded) does not wrap the same way again, also under another wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from executorch.backends.qualcomm.builders.node_visitor_manager import (
    _node_visitor_dict,
    register_node_visitor,
)


def register_wrapped_visitors(
    targets: Iterable[str], prefix: str, wrap: Callable[[type], type]
) -> None:
    """Registers `wrap(upstream)`, named `prefix + upstream name`, for each target."""
    for target in targets:
        upstream = _node_visitor_dict.get(target)
        applied = getattr(upstream, "qnn_mutbuf_wrappings", frozenset())
        if upstream is None or prefix in applied:
            continue
        wrapper = wrap(upstream)
        wrapper.__name__ = wrapper.__qualname__ = f"{prefix}{upstream.__name__}"
        wrapper.qnn_mutbuf_wrappings = applied | {prefix}
        register_node_visitor(wrapper)
