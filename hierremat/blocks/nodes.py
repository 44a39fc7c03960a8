"""What the planner knows of one node of a captured fx graph: its operator's name (the same in
every process), its module stack, whether it draws random numbers, whether its result aliases
an input, and its shape, dtype and bytes (:class:`NodeInfo`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx


@dataclass(frozen=True)
class NodeInfo:
    """What the planner needs to know of one graph node (bytes: of its output)."""

    name: str
    op: str
    target: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    aliases_input: bool
    random: bool
    module_path: str


def _tensor_meta(node: fx.Node):
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def target_name(target) -> str:
    """A node target's name, the same in every process (a Python function's repr has its address)."""
    if callable(target) and not isinstance(target, torch._ops.OpOverload):
        return fx.node._get_qualified_name(target)
    return str(target)


def module_stack(node: fx.Node) -> list[str]:
    """Module paths from outermost to innermost ('' for the root)."""
    return [path for path, _ in node.meta.get("nn_module_stack", {}).values()]


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def aliases_input(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return node.op == "call_function" and target.__name__ == "getitem"
    return any(r.alias_info is not None for r in target._schema.returns)


def describe(node: fx.Node) -> NodeInfo:
    meta = _tensor_meta(node)
    stack = module_stack(node)
    nbytes = 0
    if meta is not None:
        nbytes = int(meta.numel() * meta.element_size()) if not aliases_input(node) else 0
    return NodeInfo(
        name=node.name,
        op=node.op,
        target=target_name(node.target),
        shape=tuple(int(d) for d in meta.shape) if meta is not None else None,
        dtype=str(meta.dtype) if meta is not None else None,
        nbytes=nbytes,
        aliases_input=aliases_input(node),
        random=is_random(node),
        module_path=stack[-1] if stack else "",
    )
