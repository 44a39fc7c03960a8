"""In-place writes into values a stage did not make, made out of place (a partial functionalization).

The captured graph keeps the model's in-place operators (``ReLU(inplace=True)`` is
``aten.relu_``, a residual ``out += identity`` is ``aten.add_``). Inside a stage they are what
plain autograd runs. But an operator that overwrites a value made *outside* its stage (the
stage's input, a shared input, a resident) would overwrite what the runner holds: the
checkpoint x_i that a recomputation reads again, or the zero-byte view that taps x_i's
gradient, which autograd refuses to let a custom Function's output be modified in place.

:func:`functionalize_boundary_writes` rewrites each such call into its functional form (the
overload of the same name without the trailing underscore, ``relu_`` -> ``relu``, ``add_.Tensor``
-> ``add.Tensor``), or, where the operator has none, into the same call on a clone of the value.
Every later reader of the value, in any stage, reads the new result instead, so the graph
computes what it computed before, and the stage's input is never written. Results are bitwise
unchanged: the functional and in-place overloads run the same kernels, and autograd's formula
for the in-place form reads the original input where the functional form's does (it saves
``self`` before overwriting it). This is the rule AOTAutograd's functionalization applies to
every mutation, applied only where a write crosses a stage boundary; inside a stage the
in-place calls stay as the model wrote them.
"""

from __future__ import annotations

import torch
from torch import fx

from ..errors import UnsupportedModelError
from .joint import overwritten_argument


def functional_overload(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The functional ATen overload of an in-place one (``aten.add_.Tensor`` -> ``aten.add.Tensor``)
    taking the same arguments and returning a new tensor, or None."""
    namespace, _, name = target._schema.name.partition("::")
    if namespace != "aten" or not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None:
        return None
    schema = overload._schema
    if [a.name for a in schema.arguments] != [a.name for a in target._schema.arguments]:
        return None
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return None
    return overload


def _alias_root(node: fx.Node) -> fx.Node:
    """The value ``node`` is, through in-place calls that return their overwritten argument."""
    while (written := overwritten_argument(node)) is not None:
        node = written
    return node


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _aliases(root: fx.Node) -> list[fx.Node]:
    """``root`` and every in-place result that is ``root`` itself (relu_(root), add_(relu_(root), y), ...)."""
    found, stack = [], [root]
    while stack:
        n = stack.pop()
        found.append(n)
        stack.extend(u for u in n.users if overwritten_argument(u) is n)
    return found


def _redirect_later_reads(aliases: list[fx.Node], write: fx.Node, made: list[fx.Node], order: dict[fx.Node, int]) -> None:
    """Point every reader of ``aliases`` that runs after ``write``, and every reader of ``write``,
    at the last of ``made`` (the nodes that now compute ``write``'s result)."""
    result = made[-1]
    for alias in aliases:
        for user in list(alias.users):
            if user is not write and user not in made and order[user] > order[write]:
                user.replace_input_with(alias, result)
    if result is not write:
        for user in list(write.users):
            user.replace_input_with(write, result)


def _check_no_views(aliases: list[fx.Node], write: fx.Node, order: dict[fx.Node, int]) -> None:
    """Refuse a write whose value is seen through a view taken before it and read after it (the view
    would see the write; a view taken after it reads the new result, as every later reader does)."""
    for alias in aliases:
        for view in alias.users:
            if _is_view(view) and order[view] < order[write] and any(order[u] > order[write] for u in view.users):
                raise UnsupportedModelError(
                    f"{write.name} ({write.target}) writes in place into {alias.name}, a value made in an earlier "
                    f"stage, which {view.name} views and a later operator reads through that view. Make the "
                    f"operator out of place (e.g. inplace=False) in the model."
                )


def functionalize_boundary_writes(graph: fx.Graph, stages: list[list[fx.Node]]) -> tuple[list[list[fx.Node]], int]:
    """Rewrite the calls of each stage that overwrite a value made outside it (module docstring).

    Returns the stages with the rewritten nodes in place of the old ones, and how many calls were
    rewritten. Parameters and buffers (BatchNorm's running statistics) are written as before.
    """
    stage_of = {n: k for k, nodes in enumerate(stages) for n in nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    new_stages = [list(nodes) for nodes in stages]
    rewritten = 0
    for k, nodes in enumerate(stages):
        for node in nodes:
            written = overwritten_argument(node)
            if written is None:
                continue
            root = _alias_root(written)
            if root.op == "get_attr" or stage_of.get(root) == k:
                continue
            if _is_view(root):
                raise UnsupportedModelError(
                    f"{node.name} ({node.target}) writes in place into {root.name}, a view of a value made in an "
                    f"earlier stage. Make the operator out of place (e.g. inplace=False) in the model."
                )
            aliases = _aliases(root)
            _check_no_views(aliases, node, order)
            made = _out_of_place(graph, node, written)
            _redirect_later_reads(aliases, node, made, order)
            at = new_stages[k].index(node)
            new_stages[k][at:at + 1] = made
            if node not in made:
                graph.erase_node(node)
            order = {n: i for i, n in enumerate(graph.nodes)}
            rewritten += 1
    return new_stages, rewritten


def _out_of_place(graph: fx.Graph, node: fx.Node, written: fx.Node) -> list[fx.Node]:
    """Nodes inserted before ``node`` that give its result without writing ``written``, the last
    one the result: the functional call, or a clone of ``written`` and ``node`` writing into it."""
    functional = functional_overload(node.target)
    with graph.inserting_before(node):
        if functional is not None:
            new = graph.call_function(functional, node.args, node.kwargs)
            new.meta = dict(node.meta)
            return [new]
        clone = graph.call_function(torch.ops.aten.clone.default, (written,))
    clone.meta = {**written.meta, "nn_module_stack": node.meta.get("nn_module_stack", {})}
    node.replace_input_with(written, clone)
    return [clone, node]
