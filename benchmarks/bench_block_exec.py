"""What running a block option through hierremat's generated code costs against eager autograd.

One block at a time (a GPT-2 decoder layer, a ResNet basic block; CPU, fp32), one forward with
grad and one backward per run. Methods, side by side over interleaved rounds:
  - eager autograd: ``y = block(x); y.backward(dy)``: the kernels PyTorch picks, autograd's tape;
  - generated, keep all: the block's joint ATen graph run as the option that keeps every forward
    result the backward reads (hierremat.runtime.option_codegen's straight-line functions):
    autograd's work without autograd, so its time against eager is the executor's overhead;
  - generated, least memory: the menu's option with the least kept bytes (recomputes in backward);
  - interpreted, keep all: the same op lists run node by node by ``torch.fx.Interpreter``, the
    way options ran before code generation.
Reported per method: the median seconds, the ratio to eager autograd, and two deterministic
costs: the FLOPs counted by ``torch.utils.flop_counter`` (equal kernels, equal FLOPs) and the
sum of the graph's profiled per-op seconds that the option runs (hierremat's cost model).
Target: generated keep-all within 1.03x eager autograd.
Usage: python benchmarks/bench_block_exec.py [--rounds 31]; writes benchmarks/results/bench_block_exec.md.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

import common as C
from hierremat.blocks.capture import capture
from hierremat.blocks.joint import to_block_graph, trace_joint
from hierremat.runtime.node_profile import profile_nodes
from hierremat.blocks.segment import build_chain_graph
from hierremat.ilp.options import keep_all_decisions, make_option, solve_menu
from hierremat.ilp.solve import BlockIlp
from hierremat.runtime.block_exec import OptionExecutor, OptionTape
from hierremat.planning.stage_calls import stage_inputs
from hierremat.api.planned_shape import chain_inputs

RESULTS = C.RESULTS_DIR / "bench_block_exec.md"


def stage_of(model, args: tuple, kwargs: dict, name: str):
    """(stage, its input, the shared values) of the chain stage called ``name``."""
    chain = build_chain_graph(capture(model, args, kwargs), model)
    x0, shared = chain_inputs(chain, args, kwargs)
    i = [info.name for info in chain.infos].index(name)
    return chain.stages[i], stage_inputs(chain.stages, x0, tuple(shared))[i].detach(), tuple(shared)


def gpt2_block(width: int, seq: int, batch: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=width, n_head=max(1, width // 64), vocab_size=1024)).train()
    ids = torch.randint(0, 1024, (batch, seq))
    return stage_of(model, (ids,), {"labels": ids, "use_cache": False}, "transformer.h.0")


class BasicBlock(torch.nn.Module):
    """ResNet's basic block (two 3x3 convolutions with BatchNorm, ReLU, identity shortcut)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Methods:
    """The methods run on one block: each a callable doing one forward and backward."""

    def __init__(self, stage, x, shared):
        self.stage, self.x, self.shared = stage, x, shared
        self.params = [p for p in stage.parameters() if p.requires_grad]
        joint = trace_joint(stage, x, shared, input_requires_grad=True)
        self.graph = to_block_graph(joint, profile_nodes(joint, x, shared))
        ilp = BlockIlp(self.graph)
        keep_all = make_option(ilp.structure, keep_all_decisions(ilp.structure), "keep_all", optimal=False)
        least = min(solve_menu(self.graph, ilp=ilp).options, key=lambda o: (o.kept_bytes, o.total_time))
        self.options = {"keep all": keep_all, "least memory": least}
        self.executors = {k: OptionExecutor(joint, o) for k, o in self.options.items()}
        self.dy = torch.ones_like(stage(x, *shared))
        self.runs = {
            "eager autograd": self.eager,
            "generated, keep all": lambda: self.generated("keep all"),
            "generated, least memory": lambda: self.generated("least memory"),
            "interpreted, keep all": self.interpreted,
        }

    def eager(self):
        xi = self.x.detach().requires_grad_()
        self.stage(xi, *self.shared).backward(self.dy)

    def generated(self, which: str):
        executor = self.executors[which]
        y, tape = executor.forward(self.x, self.shared)
        del y
        executor.backward(tape, self.dy, self.shared)

    def interpreted(self):
        executor = self.executors["keep all"]
        program = executor.program
        forward, backward = program.forward_module, program.backward_module
        with torch.no_grad():
            y, *kept = fx.Interpreter(forward).run(*executor.binding.args(program.forward_inputs, self.x, self.shared))
            tape = OptionTape(kept, self.x, y)
            fx.Interpreter(backward).run(*executor.binding.args(program.backward_inputs, self.x, self.shared, self.dy, tape))

    def node_seconds(self, name: str) -> str:
        """The cost model's milliseconds of a method: the sum of the profiled times of the ops it runs."""
        if name == "eager autograd":
            return ""
        return f"{self.options['least memory' if 'least' in name else 'keep all'].total_time * 1e3:.2f}"

    def flops(self, name: str) -> int:
        with FlopCounterMode(display=False) as counter:
            self.runs[name]()
        return counter.get_total_flops()


def measure(label: str, methods: Methods, rounds: int) -> list[list[str]]:
    times: dict[str, list[float]] = {name: [] for name in methods.runs}

    def run(name, _round):
        C.zero_grads(methods.params)
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            methods.runs[name]()
            times[name].append(time.perf_counter() - t0)
        finally:
            gc.enable()

    for name in methods.runs:  # warm-up
        methods.runs[name]()
    C.interleave(list(methods.runs), rounds, seed=0, run=run)
    eager = C.median(times["eager autograd"])
    return [
        [label, name, f"{C.median(ts) * 1e3:.2f}", f"{C.median(ts) / eager:.3f}",
         f"{methods.flops(name) / 1e9:.3f}", methods.node_seconds(name)]
        for name, ts in times.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=31)
    args = p.parse_args()
    torch.manual_seed(0)
    blocks = {
        "GPT-2 layer (768 wide, batch 2, seq 256)": gpt2_block(768, 256, 2),
        "GPT-2 layer (256 wide, batch 2, seq 128)": gpt2_block(256, 128, 2),
        "ResNet basic block (64 ch, 32x32, batch 8)": (BasicBlock(64).train(), torch.randn(8, 64, 32, 32), ()),
    }
    rows = []
    for label, (stage, x, shared) in blocks.items():
        rows += measure(label, Methods(stage, x, shared), args.rounds)
    header = ["block", "method", "ms", "time / eager", "GFLOP", "profiled op ms"]
    info = C.device_info(torch.device("cpu"), torch.get_num_threads())
    text = (
        f"# Block options: generated code against eager autograd\n\nCPU ({info['device_name']}, "
        f"{info['torch_threads']} threads), fp32, forward + backward of one block per run, median of "
        f"{args.rounds} interleaved rounds; hierremat {C.library_revision()}.\n\n{C.markdown_table(header, rows)}\n"
    )
    C.write_results(RESULTS, text)


if __name__ == "__main__":
    main()
