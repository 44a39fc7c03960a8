"""Capture a model as one ATen-level graph with torch.export, and describe its nodes.

We use PyTorch's own machinery: ``torch.export.export(..., strict=False)`` traces the
forward (keyword arguments, non-tensor arguments and pytree outputs such as Hugging
Face's ``ModelOutput`` included) into an ATen-level training graph, and
``ExportedProgram.module()`` gives it back as a GraphModule whose parameters and
buffers are the model's own objects (so gradients land on them) and whose calling
convention is the model's. Each node keeps ``nn_module_stack`` (the module it came
from), and we add shape, dtype, bytes, aliasing and randomness.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import UnsupportedModelError
from .nodes import NodeInfo, describe
from .variants.cross_entropy import use_row_blocked_cross_entropy
from .variants.embedding import use_grad_in_place_embeddings
from .variants.max_pool import use_channels_last_max_pools
from .variants.linear import use_grad_in_place_linears
from .causal_attention import restore_causal_attention
from .eager_masks import restore_unpadded_bias_masks
from .symbolic import SymbolicCapture, export_call

log = logging.getLogger(__name__)


@dataclass
class CapturedModel:
    """The unlifted GraphModule of the model's program at one input shape, and per-node information.

    specialized: True where the module was specialized from a symbolic capture
    (hierremat.blocks.symbolic), False where it was exported at this shape.
    """

    module: fx.GraphModule
    nodes: dict[str, NodeInfo]
    specialized: bool = False


def _explain(err: Exception) -> str:
    text = str(err).strip().splitlines()
    first = next((line for line in text if line.strip()), type(err).__name__)
    op = re.search(r"(aten\.[\w.]+|torch\.[\w.]+)", str(err))
    hint = ""
    if "data-dependent" in str(err).lower() or "GuardOnDataDependent" in type(err).__name__:
        hint = " The forward has data-dependent control flow (a Python branch on tensor values), which cannot be captured as one graph."
    if "not a known type" in str(err) and "cache" in str(err).lower():
        hint += (" The model returns a cache object that torch.export cannot flatten; in training, call it with "
                 "use_cache=False.")
    where = f" (at {op.group(1)})" if op else ""
    return f"{type(err).__name__}{where}: {first[:300]}.{hint}"


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wraps (hierremat captures and runs the original;
    compile the remat'd model instead: ``torch.compile(hierremat.remat(model, ...))``)."""
    original = getattr(model, "_orig_mod", None)
    if isinstance(original, torch.nn.Module) and type(model).__name__ == "OptimizedModule":
        log.info("model is torch.compile'd: hierremat captures the original module; compile the remat'd model instead")
        return original
    return model


def check_outputs(outputs) -> tuple[str, ...] | None:
    """The ``outputs=`` argument as a tuple of output names (None: every output, as the model returns them)."""
    if outputs is None:
        return None
    names = (outputs,) if isinstance(outputs, str) else outputs
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"outputs must be None (every output the model returns) or the names of the outputs to return, e.g. "
            f"'loss' or ('loss', 'aux_loss'); got {outputs!r}"
        )
    return tuple(names)


def keep_outputs(gm: fx.GraphModule, names: tuple[str, ...], model_name: str) -> None:
    """Make ``gm`` return None for every named output of its result but ``names`` (the caller asked
    for them only, with ``outputs=``): what only those outputs read is then all that must exist,
    so a language model's logits need not be materialized (hierremat.planning.output_stage)."""
    spec = gm._out_spec
    example = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    if not isinstance(example, Mapping):
        returns = "one tensor" if spec.is_leaf() else f"a {type(example).__name__}"
        raise ValueError(
            f"outputs={names!r}: {model_name} returns {returns}, not named outputs (a dict or a Hugging Face "
            "ModelOutput): outputs= selects by name; leave it None"
        )
    missing = [n for n in names if n not in example]
    if missing:
        raise ValueError(f"outputs={names!r}: {model_name} returns no {missing} (it returns {list(example)})")
    kept = {leaf for n in names for leaf in pytree.tree_leaves(example[n])}
    (output,) = gm.graph.find_nodes(op="output")
    (leaves,) = output.args
    output.args = (type(leaves)(value if i in kept else None for i, value in enumerate(leaves)),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    dropped = [n for n in example if n not in names]
    log.info("%s returns %s only (outputs=%r): %s are None", model_name, ", ".join(names), names, ", ".join(dropped))


def capture(
    model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, variants: bool = True,
    outputs: tuple[str, ...] | None = None, symbolic: SymbolicCapture | None = None, export: bool = True,
) -> CapturedModel:
    """Export ``model(*args, **kwargs)``; raise UnsupportedModelError naming the problem.

    variants: also route operators to hierremat's exact, memory-lean variants where one
    applies (hierremat.blocks.variants: the row-blocked cross-entropy, embeddings and large linear
    weights whose backward adds into ``.grad``, max-pools pooled channels-last).
    outputs: the names of the outputs to return (hierremat.plan's ``outputs=``); None: all.
    symbolic: the model's symbolic capture: its program specialized at these inputs' sizes
    stands for the export where it holds for them (hierremat.blocks.symbolic); where it does not, the
    model is exported at these inputs, or with ``export`` False a ValueError is raised.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    module = symbolic.specialize(args, kwargs or {}) if symbolic is not None else None
    specialized = module is not None
    if module is None and not export:
        raise ValueError("the symbolic capture does not hold at these sizes")
    if module is None:
        module = _export(model, args, kwargs or {})
    if outputs is not None:
        keep_outputs(module, outputs, type(model).__name__)
    restore_causal_attention(module)
    restore_unpadded_bias_masks(module)
    if variants:
        use_row_blocked_cross_entropy(module)
        use_grad_in_place_embeddings(module)
        use_grad_in_place_linears(module)
        use_channels_last_max_pools(module)
    nodes = {n.name: describe(n) for n in module.graph.nodes}
    log.debug("captured %s: %d nodes%s", type(model).__name__, len(nodes), " (specialized)" if specialized else "")
    return CapturedModel(module, nodes, specialized)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The unlifted module of ``model``'s program exported at these inputs' shapes."""
    try:
        exported = export_call(model, args, kwargs)
    except Exception as err:  # torch raises many types here; all mean "cannot capture"
        raise UnsupportedModelError(
            f"hierremat could not capture {type(model).__name__} as one graph with torch.export: {_explain(err)} "
            "Wrap the part that trains as a chain (hierremat.checkpoint_sequential) or make the forward traceable."
        ) from err
    return exported.module()
