"""How a chain's stages are called and keyed: each stage's arguments from running the chain once without grad,
the structural signature that lets identical stages share one menu, and a joint graph rebound to another stage of
the same signature."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Sequence

import torch

from ..blocks.joint import JointGraph
from ..device.autocast import AutocastState
from ..runtime.profile import no_side_effects
from ..runtime.residents import keep_made, split_output, stage_shared


def rebind(joint: JointGraph, stage: torch.nn.Module) -> JointGraph:
    """The joint graph of one stage, bound to another stage of the same signature.

    Parameters and buffers are matched by position (same structure, same shapes).
    """
    if stage is joint.stage:
        return joint

    def mapping(named_a, named_b, what: str) -> dict[str, str]:
        a, b = list(named_a), list(named_b)
        if len(a) != len(b) or any(x.shape != y.shape for (_, x), (_, y) in zip(a, b)):
            raise ValueError(f"stages with one signature differ in their {what}")
        return {na: nb for (na, _), (nb, _) in zip(a, b)}

    params = mapping(joint.stage.named_parameters(remove_duplicate=False), stage.named_parameters(remove_duplicate=False), "parameters")
    buffers = mapping(joint.stage.named_buffers(remove_duplicate=False), stage.named_buffers(remove_duplicate=False), "buffers")
    return replace(
        joint,
        stage=stage,
        param_inputs={k: params[v] for k, v in joint.param_inputs.items()},
        buffer_inputs={k: buffers[v] for k, v in joint.buffer_inputs.items()},
        param_grad_names={params[k]: v for k, v in joint.param_grad_names.items()},
        mutations=tuple((n, buffers[t]) for n, t in joint.mutations),
    )


def stage_inputs(stages: Sequence, x0: torch.Tensor, shared: tuple, residents=None) -> list[torch.Tensor]:
    """x_0 .. x_{L-1}: each stage's input, by running the chain without grad (RNG and buffers restored).
    residents: the chain's ResidentLayout (hierremat.plans.stage_info), or None."""
    return stage_arguments(stages, x0, shared, residents)[0]


def stage_arguments(stages: Sequence, x0: torch.Tensor, shared: tuple, residents=None,
                    signatures: Sequence[str] | None = None) -> tuple[list[torch.Tensor], list[tuple]]:
    """(x_0 .. x_{L-1}, what each stage is called with after x: the shared values, then the
    residents made before it, None for the others), as :func:`stage_inputs` runs the chain.
    signatures: where given, a stage whose signature ran before and that makes no residents is not run
    again: the first one's output stands for its (the same shape: what menus are built from)."""
    xs = [x0.detach()]
    values: dict[int, torch.Tensor] = {}
    shareds = []
    outputs_of: dict[str, object] = {}
    autocast = AutocastState.capture((x0.device.type,))
    with no_side_effects(stages, x0), torch.no_grad():
        for i, stage in enumerate(stages):
            shareds.append(stage_shared(shared, values, residents))
            if i == len(stages) - 1:
                break
            makes = residents is not None and residents.produced_by(i)
            if signatures is not None and not makes and signatures[i] in outputs_of:
                xs.append(outputs_of[signatures[i]])
                continue
            with autocast.stage_scope():
                out = stage(xs[-1], *shareds[-1])
            if signatures is not None and not makes:
                outputs_of[signatures[i]] = out
            y, made = split_output(out, residents, i)
            keep_made(values, residents, i, made)
            xs.append(y)
    return xs, shareds


def resident_positions(residents, stage: int, shared: tuple) -> tuple[int, ...]:
    """Positions in ``shared`` (from :func:`stage_arguments`) of the floating residents stage
    ``stage`` reads: the inputs its joint graph takes with a gradient."""
    if residents is None:
        return ()
    positions = (residents.shared_count + r for r in residents.read_by(stage))
    return tuple(j for j in positions if isinstance(shared[j], torch.Tensor) and shared[j].is_floating_point())


def module_signature(stage, x: torch.Tensor) -> str:
    """A structural key for a stage of a plain chain (no captured graph to hash): per module
    in it, its class and the code of its forward, its plain attributes (sizes, flags,
    probabilities, lists of such: what a forward may branch on beyond its parameters), its
    printed configuration, its parameter and buffer shapes and dtypes, its mode; the input's
    shape and dtype, and the autocast setting. Equal keys trace to equal joint graphs, so
    stages with equal keys share one traced graph, menu and generated code."""
    autocast = AutocastState.capture((x.device.type,)).key()
    parts = [type(stage).__qualname__, repr(stage), str(tuple(x.shape)), str(x.dtype), autocast]
    if isinstance(stage, torch.nn.Module):
        parts.append(str(stage.training))
        parts += [f"{n}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}" for n, t in stage.named_parameters()]
        parts += [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in stage.named_buffers()]
        for name, module in stage.named_modules():
            cls = type(module)
            parts.append(f"{name}:{cls.__module__}.{cls.__qualname__}:{_code_digest(cls.forward)}")
            parts += [f"{name}.{k}={v!r}" for k, v in sorted(vars(module).items())
                      if not k.startswith("_") and _plain(v)]
    else:
        parts.append(_code_digest(stage))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _plain(value) -> bool:
    """Numbers, strings, flags, None, and tuples/lists/dicts of them: values whose repr is their content."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _code_digest(function) -> str:
    """A digest of a function's bytecode and constants (nested code objects included), the same in
    every process; '' for callables without Python code."""
    code = getattr(function, "__code__", None) or getattr(getattr(function, "__call__", None), "__code__", None)
    digest = hashlib.sha256()

    def add(c) -> None:
        digest.update(c.co_code)
        digest.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if hasattr(const, "co_code"):
                add(const)
            else:
                digest.update(repr(const).encode())

    if code is None:
        return ""
    add(code)
    return digest.hexdigest()[:16]
