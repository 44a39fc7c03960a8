"""hierremat's operator-variant kernels against their pure-torch references, per operator.

On CPU the kernels are the C++ extension (csrc/packed_bits.cpp); on CUDA they are Triton
(hierremat/ops/triton_kernels.py), and the fused LM head's row passes run as Triton
kernels too. Each operator runs both ways on the same inputs, interleaved over rounds
(median wall time; CUDA: synchronized around each call), checked equal (bitwise for the
masks; the fused head to fp32 rounding), with the bytes each mask operator must read
and write (a deterministic figure beside the noisy time).

Sizes: one GPT-2 MLP activation ``[tokens, 3072]`` (dropout, ReLU masks), and the LM head
of 12-layer GPT-2 (``[tokens, 768]`` hidden states, vocabulary 50257), fp32 and bf16 on
CUDA; tokens = 4096 on CUDA (batch 8 x seq 512), 1024 on CPU.

    python benchmarks/bench_kernels.py [--device cuda] [--rounds 20]

Writes benchmarks/results/bench_kernels_<device>.md.
"""

from __future__ import annotations

import argparse
import time

import torch

import common as C
from hierremat.ops import linear_cross_entropy as lce
from hierremat.ops import packed_bits as pb

MIB = 2**20


def _timed(fn, device: torch.device) -> float:
    C.synchronize(device)
    t0 = time.perf_counter()
    fn()
    C.synchronize(device)
    return time.perf_counter() - t0


def _mask_cases(tokens: int, device: torch.device, dtypes) -> list[tuple]:
    """(name, bytes moved, kernel call, reference call, equal?) per packed-mask operator."""
    cases = []
    for dtype in dtypes:
        torch.manual_seed(0)
        x = torch.randn(tokens, 3072, device=device, dtype=dtype)
        grad = torch.randn_like(x)
        mask = torch.rand(x.shape, device=device) > 0.1
        bits = pb.pack_mask_reference(mask)
        n, size, packed = x.numel(), x.element_size(), bits.numel()
        tag = str(dtype).removeprefix("torch.")
        cases += [
            (f"pack_mask (bool -> bits), {tag}", n + packed,
             lambda m=mask: torch.ops.hierremat.pack_mask(m), lambda m=mask: pb.pack_mask_reference(m)),
            (f"above_bits (ReLU mask), {tag}", n * size + packed,
             lambda x=x: torch.ops.hierremat.above_bits(x, 0.0), lambda x=x: pb.above_bits_reference(x, 0.0)),
            (f"masked_scale (dropout), {tag}", 2 * n * size + packed,
             lambda x=x, b=bits: torch.ops.hierremat.masked_scale(x, b, 1 / 0.9),
             lambda x=x, b=bits: pb.masked_scale_reference(x, b, 1 / 0.9)),
            (f"where_bits (ReLU backward), {tag}", 2 * n * size + packed,
             lambda g=grad, b=bits: torch.ops.hierremat.where_bits(g, b),
             lambda g=grad, b=bits: pb.where_bits_reference(g, b)),
        ]
    return cases


def _head_case(tokens: int, device: torch.device, dtype: torch.dtype):
    """The fused head's forward + backward with the row kernels against with torch's row ops."""
    torch.manual_seed(0)
    h = torch.randn(tokens, 768, device=device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(50257, 768, device=device)).to(dtype).requires_grad_()
    target = torch.randint(0, 50257, (tokens,), device=device)
    real = lce._row_kernels

    def step(with_kernels: bool):
        lce._row_kernels = real if with_kernels else (lambda h: None)
        try:
            loss = lce.linear_cross_entropy(h, weight, None, target)
            return (loss, *torch.autograd.grad(loss, (h, weight)))
        finally:
            lce._row_kernels = real

    return (f"fused LM head fwd+bwd, {str(dtype).removeprefix('torch.')}", None,
            lambda: step(True), lambda: step(False))


def _equal(a, b, exact: bool) -> bool:
    """Bitwise (the masks; these inputs hold no NaN), else to fp32 (bf16) rounding."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    if exact:
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return all(torch.allclose(x.float(), y.float(), rtol=2e-2 if x.dtype == torch.bfloat16 else 1e-4, atol=1e-4)
               for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if pb.cuda_kernels() is None:
            raise SystemExit("Triton is not importable: the CUDA kernels would be the references themselves")
        tokens, dtypes = 4096, (torch.float32, torch.bfloat16)
        cases = [(c, True) for c in _mask_cases(tokens, device, dtypes)]
        cases += [(_head_case(tokens, device, dtype), False) for dtype in dtypes]
    else:
        if not pb.load_cpu_kernels():
            raise SystemExit("the C++ kernels did not build: the CPU kernels would be the references themselves")
        tokens = 1024
        cases = [(c, True) for c in _mask_cases(tokens, device, (torch.float32,))]
    times = {(name, side): [] for (name, *_), _ in cases for side in ("kernel", "reference")}
    equal = {}
    for (name, _, kernel, reference), exact in cases:  # warm-up (Triton compiles here) and the check
        equal[name] = _equal(kernel(), reference(), exact)
    items = [(case, side) for case, _ in cases for side in ("kernel", "reference")]

    def run(item, _round):
        (name, _, kernel, reference), side = item
        times[name, side].append(_timed(kernel if side == "kernel" else reference, device))

    C.interleave(items, args.rounds, seed=0, run=run)
    rows = []
    for (name, moved, *_), _ in cases:
        k, r = C.median(times[name, "kernel"]), C.median(times[name, "reference"])
        rows.append([name, "" if moved is None else f"{moved / MIB:.1f}", f"{k * 1e3:.3f}", f"{r * 1e3:.3f}",
                     f"{k / r:.3f}", "" if moved is None else f"{moved / k / 1e9:.1f}", "yes" if equal[name] else "NO"])
    info = C.device_info(device, torch.get_num_threads())
    kind = "Triton" if device.type == "cuda" else "C++ (csrc/packed_bits.cpp)"
    text = (
        f"# Operator-variant kernels against their pure-torch references ({device.type})\n\n"
        f"Machine: {info['device_name']} ({info['cpu_count']} CPUs, {info['torch_threads']} torch threads); "
        f"torch {info['torch']}, hierremat {info['hierremat']} ({info['revision']}); {info['date']}.\n\n"
        f"Kernels: {kind}. {tokens} tokens. Medians of {args.rounds} interleaved rounds. *MiB moved*: the bytes "
        "the operator must read and write at least. *GB/s*: MiB moved over the kernel's time. *equal*: bitwise (masks) or to fp32 "
        "rounding (fused head).\n\n"
        + C.markdown_table(["operator", "MiB moved", "kernel ms", "reference ms", "kernel / reference", "GB/s",
                            "equal"], rows) + "\n"
    )
    C.write_results(C.RESULTS_DIR / f"bench_kernels_{device.type}.md", text)


if __name__ == "__main__":
    main()
