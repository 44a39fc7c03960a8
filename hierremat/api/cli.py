"""``python -m hierremat``: what a memory budget costs, before training.

Plans a model on example inputs and prints the plan summary at ``--budget`` and the
memory-against-time menu: the predicted peak and step time at budgets from the smallest
feasible one to keeping everything. Nothing is trained and nothing is downloaded: Hugging
Face models are built from their config with random weights.

    python -m hierremat --hf gpt2 --set n_layer=4 --set n_embd=256 --batch 2 --seq 128 --budget 0.5x
    python -m hierremat --hf path/to/config.json --budget 3GiB
    python -m hierremat --model my_model.py:build --budget 512MiB

``--outputs loss``: the training step uses the loss only (hierremat.plan's ``outputs=``): the
other outputs are not returned, so a language model's head may run fused with its loss.
``--grads kept``: plan for ``.grad`` allocated before each step (``zero_grad(set_to_none=False)``);
by default the budget counts the gradients each step allocates (PyTorch's default ``zero_grad``).
``--model FILE.py:FUNCTION``: FUNCTION() returns ``(model, args)`` or ``(model, args, kwargs)``,
the example inputs ``hierremat.plan`` takes. Budgets are bytes with units ("512MiB") or a
fraction of keeping everything ("0.5x").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import sys
from pathlib import Path

from ..budget import format_bytes, parse_budget
from ..errors import InfeasibleBudgetError, OffloadError

log = logging.getLogger(__name__)

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m hierremat", description="Plan a model under a memory budget and print what each budget costs.",
        epilog="Example: python -m hierremat --hf gpt2 --set n_layer=4 --batch 2 --seq 128 --budget 0.5x",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="TYPE_OR_CONFIG", help="a Hugging Face model type ('gpt2', 'llama') or a "
                     "config.json / model directory; built as a causal LM with random weights")
    src.add_argument("--model", metavar="FILE.py:FUNCTION", help="FUNCTION() returns (model, args) or "
                     "(model, args, kwargs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the Hugging Face config (repeatable), e.g. --set n_layer=4")
    ap.add_argument("--batch", type=int, default=2, help="--hf: batch size (default 2)")
    ap.add_argument("--seq", type=int, default=128, help="--hf: sequence length (default 128)")
    ap.add_argument("--budget", help="plan summary at this budget: bytes with units ('512MiB') or a fraction "
                    "of keeping everything ('0.5x'); default: the menu only")
    ap.add_argument("--points", type=int, default=6, help="budgets in the menu (default 6, at least 2)")
    ap.add_argument("--output-held", choices=("yes", "no", "auto"), default=None,
                    help="whether the training step keeps the model's outputs alive through the backward (default: "
                    "'no' for --hf, as `model(**batch).loss.backward()` does; 'auto' for --model: see hierremat.plan)")
    ap.add_argument("--grads", choices=("step", "kept"), default="step",
                    help="'step' (default): each training step allocates the parameter gradients, as after "
                    "PyTorch's default zero_grad(set_to_none=True), and the budget counts them; 'kept': .grad is "
                    "allocated before the step and kept (zero_grad(set_to_none=False))")
    ap.add_argument("--device", default="cpu", help="where to measure and plan: cpu (default) or cuda")
    ap.add_argument("--bf16", action="store_true", help="plan under bf16 autocast")
    ap.add_argument("--no-variants", action="store_true", help="the model's own operators (variants=False)")
    ap.add_argument("--outputs", metavar="NAMES", help="the outputs the training step uses, comma-separated (e.g. "
                    "'loss': the others are not returned, so a language model's head may run fused with its loss; "
                    "see hierremat.plan's outputs=); default: all")
    ap.add_argument("--offload", nargs="?", const=True, default=False, metavar="DIR",
                    help="checkpoints may also be offloaded to a second tier (host memory on CUDA, a temporary "
                         "directory on CPU, or DIR): the plans choose it where it is faster than recomputing")
    ap.add_argument("--offload-limit", metavar="BYTES", help="with --offload: the most the second tier holds at once "
                    "('8GiB'; default half of the free host memory or disk space)")
    ap.add_argument("--json", action="store_true", help="print the menu (and the plan) as JSON instead")
    ap.add_argument("-v", "--verbose", action="store_true", help="hierremat's INFO logs")
    args = ap.parse_args(argv)
    if args.points < 2:
        ap.error(f"--points must be at least 2, got {args.points}")
    if args.set and not args.hf:
        ap.error("--set overrides Hugging Face config fields: use it with --hf")
    return args


def config_overrides(pairs: list[str]) -> dict:
    """``["n_layer=4", "tie_word_embeddings=false"]`` -> ``{"n_layer": 4, "tie_word_embeddings": False}``."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {pair!r}: write KEY=VALUE, e.g. --set n_layer=4")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def hf_model(spec: str, overrides: dict, batch: int, seq: int):
    """A causal LM with random weights from a model type or a local config, and example inputs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(spec)
    config = (AutoConfig.from_pretrained(path, **overrides) if path.exists()
              else AutoConfig.for_model(spec, **overrides))
    model = AutoModelForCausalLM.from_config(config).train()
    try:  # the loss set explicitly: else transformers warns from inside the forward that it picks this one
        from transformers.loss.loss_utils import LOSS_MAPPING

        model.loss_function = LOSS_MAPPING["ForCausalLM"]
    except (ImportError, KeyError, AttributeError):
        pass
    vocab = getattr(config, "vocab_size", None) or 32000
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (ids,), {"labels": ids, "use_cache": False}


def file_model(spec: str):
    """Load FILE.py and call FUNCTION(): (model, args) or (model, args, kwargs)."""
    file, sep, func = spec.rpartition(":")
    if not sep or not file:
        raise SystemExit(f"--model {spec!r}: write FILE.py:FUNCTION")
    module_spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    if module_spec is None or not Path(file).is_file():
        raise SystemExit(f"--model {spec!r}: no such file {file!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, func):
        raise SystemExit(f"--model {spec!r}: {file} defines no {func!r}")
    made = getattr(module, func)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise SystemExit(f"--model {spec!r}: {func}() must return (model, args) or (model, args, kwargs)")
    model, example_args, *rest = made
    return model, example_args if isinstance(example_args, tuple) else (example_args,), (rest[0] if rest else {})


def resolve_budget(text: str, keep_all: int) -> int:
    """``'0.5x'`` -> half of keeping everything; anything else as hierremat.parse_budget reads it."""
    if text.endswith("x"):
        try:
            fraction = float(text[:-1])
        except ValueError:
            raise SystemExit(f"--budget {text!r}: write a fraction like '0.5x' or bytes like '512MiB'") from None
        if fraction <= 0:
            raise SystemExit(f"--budget {text!r}: the fraction must be positive")
        return int(keep_all * fraction)
    return parse_budget(text, name="--budget")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.offload_limit and not args.offload:
        print("--offload-limit needs --offload (a second tier to limit)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    import torch
    from torch.utils import _pytree as pytree

    from .explore import explore
    from .settings import Settings

    if args.hf:
        model, example_args, example_kwargs = hf_model(args.hf, config_overrides(args.set), args.batch, args.seq)
    else:
        model, example_args, example_kwargs = file_model(args.model)
    device = torch.device(args.device)
    model.to(device)
    for p in model.parameters():  # what the step starts with: plans count the gradients it allocates
        p.grad = torch.zeros_like(p) if args.grads == "kept" and p.requires_grad else None
    example_args, example_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                                        (example_args, example_kwargs))
    with torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext():
        held = {"yes": True, "no": False, "auto": None}[args.output_held or ("no" if args.hf else "auto")]
        outputs = tuple(n.strip() for n in args.outputs.split(",") if n.strip()) if args.outputs else None
        try:
            settings = Settings(variants=not args.no_variants, output_held=held, offload=args.offload,
                                offload_limit=args.offload_limit)
            explorer = explore(model, example_args, example_kwargs, outputs=outputs, settings=settings)
        except OffloadError as err:
            print(f"--offload: {err}", file=sys.stderr)
            return 2
        menu = explorer.menu(args.points)
        chosen = None
        if args.budget:
            try:
                chosen = explorer.plan(f"{resolve_budget(args.budget, explorer.keep_all_bytes)}B")
            except InfeasibleBudgetError as err:
                print(f"--budget {args.budget}: {err}", file=sys.stderr)
                return 2
    if args.json:
        out = {
            "smallest_feasible_bytes": explorer.smallest_feasible_bytes, "keep_all_peak_bytes": explorer.keep_all_bytes,
            "menu": [{"budget_bytes": p.budget_bytes, "predicted_peak_bytes": p.predicted_peak_bytes,
                      "predicted_step_seconds": p.predicted_step_time,
                      "stage_forwards": sum(p.chain.schedule.forward_counts())} for p in menu],
        }
        if chosen is not None:
            out["plan"] = json.loads(chosen.to_json())
        print(json.dumps(out, indent=1))
        return 0
    if chosen is not None:
        print(chosen.summary(), "\n")
    print(render_menu(menu, explorer.keep_all_bytes))
    return 0


def render_menu(menu, keep_all: int) -> str:
    """The memory-against-time table of ``menu`` (ModelPlans, smallest budget first)."""
    keep_all_seconds = menu[-1].chain.no_remat_step_time
    lines = [
        f"memory against time (keeping everything: peak {format_bytes(keep_all)}, step "
        f"{keep_all_seconds * 1e3:.1f} ms; predicted from profiled op times):",
        f"  {'budget':>11}  {'x keep-all':>10}  {'pred. peak':>11}  {'pred. step ms':>13}  {'x keep-all':>10}  forwards",
    ]
    for i, p in enumerate(menu):
        lines.append(
            f"  {format_bytes(p.budget_bytes):>11}  {p.budget_bytes / keep_all:>10.3f}  "
            f"{format_bytes(p.predicted_peak_bytes):>11}  {p.predicted_step_time * 1e3:>13.1f}  "
            f"{p.predicted_step_time / keep_all_seconds:>10.3f}  {sum(p.chain.schedule.forward_counts()):>8}"
            + ("  (smallest feasible)" if i == 0 else "")
        )
    return "\n".join(lines)
