"""Which ATen op of a planned step gives other bits than plain autograd's from the same inputs.

A diagnosis, not a comparison. On CUDA under bf16 autocast, a replayed block option's gradients were found 1e-4
from plain autograd's (2026-11-27, H200), where on CPU they are bitwise; and a model held in bf16 is one ulp off
even keeping everything. This finds the op that departs, without aligning the two steps' op sequences:

* every ATen op of a training step is recorded (a TorchDispatchMode, which autograd's device threads inherit):
  its name, its non-tensor arguments, and for each tensor it reads and writes an exact digest of each of its rows
  (so that a chunked LM head's logits are plain's rows), its dtype, shape and strides;
* plain autograd's step is recorded twice (ops whose outputs differ between the two, same inputs, are
  nondeterministic kernels: CUDA's embedding backward, say), then hierremat's at the smallest feasible budget
  (block options in its schedule) or keeping everything; a compiled block option's fused kernels run no ATen op
  (its extern matmuls do, on values not known), so where one departs no op is named but the results differ (then
  compare with ``--compile off``);
* a value is *known* where plain's steps read or made it. An op of hierremat's step whose inputs are all known and
  which makes a value that is not is where the two steps part: printed in order with its inputs' strides, beside
  plain's op of the same name and inputs where one exists (same values in, other bits out: a kernel chosen by
  layout or by an argument) or, where none does, the plain ops of the same name that read one of its inputs
  (the graph computes it another way).

    python benchmarks/bits_by_op.py [--model gpt2|llama] [--autocast bf16|fp16|off] [--held bf16]
                                    [--budget floor|keep] [--device cuda|cpu] [--no-variants] [--compile auto|on|off]
                                    [--replayed-under-autocast] [--self-check]

Prints Markdown. On CPU the same run is the control: every bf16 test there is bitwise, so nothing should part.
"""
import argparse
import copy
import sys
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, "tests")
import hierremat as hr  # noqa: E402
from hierremat.planning import menus  # noqa: E402
from models import tiny_gpt2, tiny_llama  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
parser.add_argument("--autocast", choices=("bf16", "fp16", "off"), default="bf16")
parser.add_argument("--held", choices=("fp32", "bf16"), default="fp32", help="the dtype the model is held in")
parser.add_argument("--budget", choices=("floor", "keep"), default="floor")
parser.add_argument("--device", default="cuda")
parser.add_argument("--no-variants", action="store_true")
parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="block options compiled")
parser.add_argument("--replayed-under-autocast", action="store_true",
                    help="block options under autocast on a device outside menus.AUTOCAST_EXACT_DEVICE_TYPES too")
parser.add_argument("--self-check", action="store_true",
                    help="flip one bit of the third backward matmul of hierremat's step: exit 0 only where that op is "
                         "the first named (the diagnosis checked against a known fault; tests/test_bits_by_op.py)")
parser.add_argument("--show", type=int, default=12, help="how many parting ops to print")
args = parser.parse_args()


@dataclass(frozen=True)
class Seen:
    """One tensor an op read or wrote: an exact digest of each of its rows (the last dimension's) and its layout."""
    rows: tuple[int, ...]
    dtype: str
    shape: tuple
    stride: tuple

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} stride {list(self.stride)} #{hash(self.rows) % 16**6:06x}"


@dataclass(frozen=True)
class Op:
    name: str
    arguments: str  # the non-tensor arguments, tensors as "T"
    inputs: tuple[Seen, ...]
    outputs: tuple[Seen, ...]
    phase: str
    view: bool  # its outputs alias its inputs


_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _seen(t: torch.Tensor) -> Seen:
    """Rows, not whole tensors: a chunked LM head makes plain's logits a few rows at a time. A row's digest is
    the sum of its elements' bits times odd weights, modulo 2**64: a change of any bit changes it."""
    x = t.detach()
    if x.numel() == 0:
        return Seen((), str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
    x = x.reshape(-1, x.shape[-1] if x.dim() else 1)
    n = x.shape[-1]
    key = (n, x.device)
    if key not in _WEIGHTS:
        odd = torch.randint(1, 2**31, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64) | 1
        _WEIGHTS[key] = odd.to(x.device)
    bits = x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).to(torch.int64)
    rows = (bits * _WEIGHTS[key]).sum(-1) + n * 1_000_003
    return Seen(tuple(rows.tolist()), str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))


FAULTY_OP, FAULTY_CALL = "aten.mm.default", 3  # (--self-check: the third backward matmul)


class Recorder(TorchDispatchMode):
    def __init__(self, fault: bool = False):
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "forward"
        self.fault = fault  # flip the lowest bit of FAULTY_OP's FAULTY_CALL-th backward result's first element
        self.faulted: int | None = None  # the index of the op faulted
        self._calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        inputs = tuple(_seen(t) for t in tensors)
        result = func(*args, **kwargs)
        if self.fault and self.phase == "backward" and str(func) == FAULTY_OP:
            self._calls += 1
            if self._calls == FAULTY_CALL:
                bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[result.element_size()]
                result.view(-1)[:1].view(bits).bitwise_xor_(1)
                self.faulted = len(self.ops)
        written = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        # (an in-place or out= op's result is its argument: its bytes after the op)
        arguments = repr([("T" if isinstance(a, torch.Tensor) else a) for a in flat])
        self.ops.append(Op(str(func), arguments, inputs, tuple(_seen(t) for t in written), self.phase, func.is_view))
        return result


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = (tiny_gpt2(n_layer=2) if args.model == "gpt2" else tiny_llama()).to(args.device)
    return model.to(torch.bfloat16) if args.held == "bf16" else model


device = torch.device(args.device)
model = make_model()
reference = copy.deepcopy(model)
ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1)).to(device)
kwargs = {"labels": ids, "use_cache": False}
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": torch.bfloat16}[args.autocast]
autocast = torch.autocast(device.type, dtype=dtype, enabled=args.autocast != "off")


def step(m: torch.nn.Module, recorder: Recorder | None) -> list[torch.Tensor]:
    """The "fresh" recipe (torch's AMP docs): autocast around the forward, the backward outside it."""
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(7)
    if recorder is None:
        with autocast:
            loss = m(ids, **kwargs).loss
        loss.backward()
    else:
        with recorder:
            with autocast:
                loss = m(ids, **kwargs).loss
            recorder.phase = "backward"
            loss.backward()
    return [loss.detach().clone()] + [p.grad.clone() for p in m.parameters()]


if args.replayed_under_autocast:
    menus.AUTOCAST_EXACT_DEVICE_TYPES = (*menus.AUTOCAST_EXACT_DEVICE_TYPES, device.type)
variants = not args.no_variants
compile = {"auto": "auto", "on": True, "off": False}[args.compile]
with autocast:
    try:
        hr.plan(model, (ids,), kwargs, budget="1KiB",
                settings=hr.Settings(cache=False, variants=variants, backward_autocast=False, compile=compile))
        raise SystemExit("a 1 KiB budget was feasible")
    except hr.InfeasibleBudgetError as err:
        floor = err.min_budget_bytes
    keep = hr.plan(model, (ids,), kwargs, budget="64GiB",
                   settings=hr.Settings(cache=False, variants=variants, backward_autocast=False, compile=compile)).predicted_peak_bytes
    budget = floor if args.budget == "floor" else keep
    module = hr.remat(model, (ids,), kwargs, budget=f"{budget}B",
                      settings=hr.Settings(cache=False, variants=variants, backward_autocast=False, defer_block_options=False, compile=compile))
step(module, None)  # (warm: anything made at the first call)
plains = [Recorder(), Recorder()]
expected = [step(reference, r) for r in plains]
ours = Recorder(fault=args.self_check)
got = step(module, ours)

names = ["loss"] + [n for n, _ in reference.named_parameters()]
(plan,) = module.plans
print(f"# bits by op: {args.model}, autocast {args.autocast}, held {args.held}, {args.device}, budget {args.budget} "
      f"({budget} B), variants {variants}, compile {args.compile}, block options under autocast "
      f"{menus.AUTOCAST_EXACT_DEVICE_TYPES}\n")
print(plan.summary())
differing = []
for name, a, b, again in zip(names, got, *expected):
    if not torch.equal(a, b):
        varies = "" if torch.equal(b, again) else " (plain's two runs differ too)"
        share = (a != b).float().mean().item()
        differing.append(f"- {name}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}, "
                         f"{share:.1%} of elements{varies}")
print(f"\n{len(differing)} of {len(names)} results differ from plain autograd's:")
print("\n".join(differing) or "- none")

known = set()  # rows plain's steps read or made
by_key: dict[tuple, list[Op]] = {}
for recorder in plains:
    for op in recorder.ops:
        known.update(r for s in op.inputs + op.outputs for r in s.rows)
        by_key.setdefault((op.name, op.arguments, tuple(s.rows for s in op.inputs)), []).append(op)
varying = {key for key, ops in by_key.items() if len({tuple(s.rows for s in o.outputs) for o in ops}) > 1}
print(f"\nops recorded: plain {len(plains[0].ops)} and {len(plains[1].ops)} "
      f"({sum(op.phase == 'backward' for op in plains[0].ops)} in the backward), hierremat {len(ours.ops)}; "
      f"plain's ops with the same inputs and other outputs between its two runs: "
      f"{sorted({key[0] for key in varying}) or 'none'}")
# An op of ours whose inputs are all known and which makes floating rows plain never made parts from plain. Its other
# results join the known values (packed masks, views of known values: new by design, exact functions of known ones;
# uninitialized buffers).
parting = []
for index, op in enumerate(ours.ops):
    if not all(r in known for s in op.inputs for r in s.rows):
        continue
    new_rows = [s for s in op.outputs
                if s.dtype.startswith(("float", "bfloat")) and any(r not in known for r in s.rows)]
    uninitialized = op.name.split(".")[1].startswith(("empty", "new_empty"))  # (bytes left from before)
    if new_rows and not op.view and not uninitialized:
        parting.append((index, op))
    else:
        known.update(r for s in op.outputs for r in s.rows)
print(f"\n{len(parting)} of hierremat's ops read known values and make floating values plain never made (where the "
      f"two steps part); the first {args.show}:")
for index, op in parting[: args.show]:
    key = (op.name, op.arguments, tuple(s.rows for s in op.inputs))
    print(f"\n## op {index} ({op.phase}): {op.name} {op.arguments}")
    print("  reads:  " + "; ".join(map(str, op.inputs)))
    print("  writes: " + "; ".join(map(str, op.outputs)))
    if key in by_key:
        twin = by_key[key][0]
        kind = "nondeterministic in plain too" if key in varying else "same values in, other bits out"
        print(f"  plain's same op ({kind}):")
        print("    reads:  " + "; ".join(map(str, twin.inputs)))
        print("    writes: " + "; ".join(map(str, twin.outputs)))
    else:
        read = {s.rows for s in op.inputs}
        near = [o for o in plains[0].ops if o.name == op.name and read & {s.rows for s in o.inputs}]
        print(f"  plain has no {op.name} of these inputs; its {op.name} ops reading one of them: {len(near)}")
        for o in near[:3]:
            print(f"    {o.arguments} reads " + "; ".join(map(str, o.inputs)))
        users = sorted({o.name for o in plains[0].ops if read & {s.rows for s in o.inputs}})
        print(f"  plain's ops reading one of these inputs: {users[:12]}")
if args.self_check:
    named = parting[0][0] if parting else None
    print(f"\nself-check: the fault was put at op {ours.faulted}; the first op named is {named}")
    sys.exit(0 if ours.faulted is not None and named == ours.faulted else 1)
