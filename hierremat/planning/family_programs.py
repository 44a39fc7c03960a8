"""Block options' graphs and code shared by every shape of a family: one joint graph per stage, traced once.

At a shape of a family whose stages run size-generic graphs (hierremat.blocks.generic.GenericChain), a stage's
block options need its joint graph at that shape, for the BlockGraph their costs are read from and for the code
that runs them. Traced at each shape, each shape's plan held graphs and generated code of its own (1.7 MiB for a
4-layer GPT-2). :class:`FamilyPrograms` holds, for one generic chain, each stage's joint graph traced once with
symbolic sizes (hierremat.blocks.symbolic_joint), and the programs generated from it: every later shape costs its
block options on that graph at its sizes (JointGraph.sizes) and runs the same programs.

The symbolic graph is made at a shape whose joint graph was traced there: its nodes are renamed as that graph's
(menus and node times name them so) and it is kept only where its BlockGraph at that shape is that graph's, node
for node and byte for byte. A shape its trace does not hold for (a guard that fails there) traces its own.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Sequence

import torch

from ..blocks.generic import NotGeneric, fold_size
from ..blocks.joint import JointGraph, is_size_node, size_expr, to_block_graph
from ..blocks.symbolic_joint import SymbolicJoint, as_traced, size_sources, trace_symbolic_joint
from ..plans.block_options import BlockOption, ForwardOnly
from ..runtime.block_exec import GeneratedForward, GeneratedOption
from .output_stage import fused_head_stage

log = logging.getLogger(__name__)

_NOT_MADE = object()  # (FamilyPrograms.fused_head not made yet)


class FamilyPrograms:
    """Joint graphs traced with symbolic sizes, and the programs generated from them, for the stages of one
    size-generic chain (``stages``, its GraphStages), shared by every shape that runs them.

    joints: (stage index, trace settings) -> the stage's SymbolicJoint, or None where one could not be made (not
    tried again). options / forwards: (stage index, trace settings, op lists) -> the program, made on first run."""

    def __init__(self, stages: Sequence[torch.nn.Module]):
        self.stages = tuple(stages)
        self.joints: dict[tuple, SymbolicJoint | None] = {}
        self.options: dict[tuple, GeneratedOption] = {}
        self.forwards: dict[tuple, GeneratedForward] = {}
        self._fused_head: object = _NOT_MADE

    def joint_at(self, key: tuple, x: torch.Tensor, shared: tuple) -> JointGraph | None:
        """Stage ``key[0]``'s joint graph at the sizes of ``x`` and ``shared`` (SymbolicJoint.at_sizes); None where
        none was made for ``key`` or it does not hold there."""
        symbolic = self.joints.get(key)
        try:
            return symbolic.at_sizes(x, shared) if symbolic is not None else None
        except Exception as err:  # (a size or guard it cannot read: this shape traces its own)
            log.info("stage %d: the joint graph for every shape not read at this shape (%s)", key[0], err)
            return None

    def adopt(self, key: tuple, traced: JointGraph, x: torch.Tensor, shared: tuple, rewrite: Callable,
              structure: Callable, **trace_options) -> None:
        """Trace stage ``key[0]`` of ``stages`` with symbolic sizes, rewrite it as ``traced`` was (``rewrite``: the
        operator variants; symbolic_joint.as_traced: its nodes named as ``traced``'s, run in place where they are),
        and keep it where its BlockGraph at these sizes is ``traced``'s (``structure``: what is compared,
        hierremat.planning.menu_store.graph_structure). Once per key: a graph that could not be made is not tried again."""
        if key in self.joints:
            return
        self.joints[key] = None
        i = key[0]
        try:
            symbolic = trace_symbolic_joint(self.stages[i], x, shared, **trace_options)
            joint = as_traced(rewrite(symbolic.joint), traced)
            if joint is None:
                raise NotGeneric("its operators are not those of the graph traced at this shape")
            symbolic = replace(symbolic, joint=joint)
            _check_size_sources(joint)
            here = symbolic.at_sizes(x, shared)
            if here is None or structure(to_block_graph(here)) != structure(to_block_graph(traced)):
                raise NotGeneric("its BlockGraph at this shape is not the one traced here")
        except Exception as err:  # (any failure: the family's shapes trace their own, as before)
            log.info("stage %d: no joint graph for every shape (%s): each shape traces its own", i, err,
                     exc_info=log.isEnabledFor(logging.DEBUG))
            return
        self.joints[key] = symbolic
        log.info("stage %d: one joint graph for every shape of its family", i)

    def option(self, key: tuple, joint: JointGraph, option: BlockOption) -> GeneratedOption:
        """The program of ``option`` on stage ``key[0]``'s symbolic joint graph (``joint``, at any sizes), shared by
        every shape whose option computes and frees the same nodes and keeps the same of x and y (its pins: what
        the backward reads)."""
        op_key = (key, option.fwd_ops, option.bwd_ops, option.pins_input, option.pins_output)
        generated = self.options.get(op_key)
        if generated is None:
            generated = self.options[op_key] = GeneratedOption(replace(joint, sizes=None), option)
        return generated

    def forward(self, key: tuple, joint: JointGraph, forward: ForwardOnly) -> GeneratedForward:
        """The no-grad forward program of ``forward``'s op list on stage ``key[0]``'s symbolic joint graph."""
        op_key = (key, forward.ops)
        generated = self.forwards.get(op_key)
        if generated is None:
            generated = self.forwards[op_key] = GeneratedForward(replace(joint, sizes=None), forward)
        return generated

    def fused_head(self):
        """The last stage with its LM head fused with the loss (hierremat.planning.output_stage.fused_head_stage),
        made once from the generic stage: its sizes computed from its inputs, every shape runs it; None where the
        fused head does not apply."""
        if self._fused_head is _NOT_MADE:
            self._fused_head = fused_head_stage(self.stages[-1])
        return self._fused_head

    def graph_modules(self) -> list:
        """Every GraphModule it holds: the joint graphs, and the programs generated so far (whose fx sources are
        forgotten with it: hierremat.blocks.sources)."""
        modules = [symbolic.joint.module for symbolic in self.joints.values() if symbolic is not None]
        if self._fused_head is not _NOT_MADE and self._fused_head is not None:
            modules.append(self._fused_head.graph_module)
        for generated in (*self.options.values(), *self.forwards.values()):
            modules += generated.modules()
        return modules


def _check_size_sources(joint: JointGraph) -> None:
    """Raise NotGeneric where a size of ``joint`` could not be computed in a phase of an option's generated code
    (hierremat.runtime.option_codegen computes each from an input the phase has, with the operations
    hierremat.blocks.generic.fold_size knows; a SymFloat or SymBool is none): every symbol must be a dimension of
    x or a shared value (the forward has them), and of the output gradient or a shared value (the backward has them,
    not x where the option does not keep it)."""
    forward = {joint.input_name, *joint.shared_names}
    backward = {*joint.tangent_names.values(), *joint.shared_names}
    sources = size_sources(joint)
    needed = set()
    for node in joint.compute_nodes():
        if is_size_node(node):
            expr = size_expr(node.meta["val"])  # (raises ValueError for a SymFloat or SymBool)
            fold_size(expr, lambda symbol: 1, lambda op, a, b: 1)  # (raises NotGeneric for an operation it lacks)
            needed |= expr.free_symbols
    for symbol in needed:
        names = {name for name, _ in sources.get(symbol, ())}
        if not names & forward or not names & backward:
            raise NotGeneric(f"the size {symbol} is a dimension of no input both phases have")
