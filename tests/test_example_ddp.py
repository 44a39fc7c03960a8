"""examples/gpt2/finetune.py under torchrun: 2 DDP ranks train the same weights as one process.

``torchrun --standalone --nproc_per_node 2`` (gloo, CPU) with ``--batch 2`` per rank against
one process with ``--batch 4``, both for 2 steps on the tiny GPT-2 with the same seed: they
start from the same seeded weights, draw the same global batches in the same order (each
rank keeps its half), run with ``--dropout 0`` (with dropout each rank draws its own masks)
and plan with recomputation, so the ranks' gradients come out of the chain's backward and
must reach DDP's all-reduce.

The saved parameters agree up to float32 rounding, not bit for bit: DDP averages the two
ranks' gradients, (g0 + g1) / 2, where one process reduces them inside one batch-of-4
loss, and matmuls over 2 rows block differently than over 4. Measured (torch 2.13, CPU,
OMP_NUM_THREADS=1, seeds 0 to 2): max abs parameter difference 9.4e-7 to 2.1e-5, on at
most a couple of the ~0.8M elements; relative L2 error of the update (final - initial
weights) 4.9e-5. The outliers are AdamW's: its first steps move an element by about
lr * g / (|g| + eps), so an element whose gradient nearly cancels to 0 turns a rounding
difference of 1e-10 into an update difference of up to lr * 1e-10 / eps ~ 3e-6 per step.

Tolerances: atol 1e-4 per element (about 5x the worst measured; 2 steps at lr 3e-4 move
an element by up to 6e-4, about what a rank that skipped the all-reduce is off by) and
1e-3 on the relative update error (a missing all-reduce gives errors of order 0.1 to 1).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt2" / "finetune.py"
# 0.7 of plain's peak: at 2 x 64 tokens per rank the gradients each step allocates (the example calls
# PyTorch's default zero_grad) are most of half of it
COMMON = ["--size", "tiny", "--steps", "2", "--seq-len", "64", "--dropout", "0", "--seed", "0",
          "--budget-fraction", "0.7", "--device", "cpu"]
PER_RANK_BATCH = 2
ATOL = 1e-4
UPDATE_RTOL = 1e-3


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{output[-6000:]}"
    return output


def _initial_weights() -> dict:
    """The seeded initial weights of the example (before any step)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_example_ddp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model, _ = module.load_model_and_tokenizer(module.parse_args(COMMON))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_two_ranks_train_the_same_weights_as_one_process(tmp_path):
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    ddp_log = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "--log-dir", str(tmp_path / "torchrun-logs"),  # (else a torchelastic_* directory in /tmp)
                    str(EXAMPLE), *COMMON, "--batch", str(PER_RANK_BATCH), "--out", str(ddp_out)])
    _run([sys.executable, str(EXAMPLE), *COMMON, "--batch", str(2 * PER_RANK_BATCH), "--out", str(single_out)])

    # Only rank 0 prints the plan and the final report.
    assert ddp_log.count("hierremat model plan") == 1 and ddp_log.count("measured peak") == 1, ddp_log[-3000:]
    ddp_report = json.loads((ddp_out / "report.json").read_text())
    single_report = json.loads((single_out / "report.json").read_text())
    assert ddp_report["world_size"] == 2 and ddp_report["global_batch"] == 2 * PER_RANK_BATCH
    assert single_report["world_size"] == 1 and single_report["global_batch"] == 2 * PER_RANK_BATCH
    # The rank-averaged training losses are the one-process losses of the same global batches.
    assert ddp_report["train_losses"] == pytest.approx(single_report["train_losses"], rel=1e-5)

    import hierremat as hr

    plan = hr.ModelPlan.from_json((ddp_out / "plan.json").read_text())
    # the gradients must come through hierremat's chain backward (recomputed stages or block options)
    assert not plan.chain.schedule.keeps_everything, "the plan should not run as plain autograd"

    ddp = safetensors_torch.load_file(str(ddp_out / "model" / "model.safetensors"))
    single = safetensors_torch.load_file(str(single_out / "model" / "model.safetensors"))
    assert ddp.keys() == single.keys()
    initial = _initial_weights()
    max_abs = max((ddp[k] - single[k]).abs().max().item() for k in ddp)
    moved = sum((single[k] - initial[k]).pow(2).sum().item() for k in single) ** 0.5
    update_err = sum(((ddp[k] - initial[k]) - (single[k] - initial[k])).pow(2).sum().item() for k in ddp) ** 0.5
    assert moved > 0, "training did not change the weights"
    print(f"max abs param diff {max_abs:.3g}; relative update error {update_err / moved:.3g}")
    assert max_abs <= ATOL, f"max abs parameter difference {max_abs:.3g} > {ATOL}"
    assert update_err / moved <= UPDATE_RTOL, f"relative update error {update_err / moved:.3g} > {UPDATE_RTOL}"
