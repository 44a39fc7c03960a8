"""hierremat under FSDP2 and DDP: plan the whole model, then shard or wrap it.

``torchrun --nproc_per_node 2`` (gloo, CPU) runs tests/distributed_train.py: each rank trains
its half of every global batch for 3 AdamW steps; one process trains plainly on the whole
batches. Models: a tiny Llama (3 layers) and a tiny T5 (2+2 layers, no dropout: the ranks'
halves would draw other masks than one process), whose decoder layers read the encoder's
output and whose layers read the position biases: residents, whose gradients hierremat sums
across their readers. FSDP2: ``fully_shard`` on every layer and the model, budgets of 3.3 MiB
(Llama; FSDP2's gathered parameters included: the smallest feasible is 3.06 MiB, FSDP2 alone
peaks at about 6.5 MiB) and 3.1 MiB (T5; FSDP2 alone: about 3.6 MiB) per rank. DDP: the
planned module wrapped in ``DistributedDataParallel`` with its defaults, although T5's tied
embedding and LM head are read by two stages (hierremat.runtime.tied). Checked:

* the first step's gradients are bitwise those of FSDP2 or DDP alone on the same batches,
  in fp32 and under bf16 autocast (forward and planning inside the context);
* in fp32, the parameters agree with one process's to float32 rounding (the tolerances of
  tests/test_example_ddp.py, for the same reasons: the ranks' gradients are averaged where
  one process reduces inside one batch);
* the plan recomputes, every rank runs rank 0's plan, and FSDP2 gathers each layer for
  each of its forwards before the loss and once more for its backward;
* each rank's allocator-measured peak of a steady step (the last: gradients and optimizer
  states allocated, DDP's buckets rebuilt) is within the budget and below FSDP2's or DDP's
  alone. The CPU allocator meter is used because FSDP2 frees and refills gathered
  parameters by resizing their storages, which the live-tensor tracker does not see.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import hierremat as hr  # noqa: E402
from hierremat.plans.schedule import OffloadKept  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "distributed_train.py"
ATOL = 1e-4


def _env(device: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # (a rank that crashes prints its Python stack)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    return env


def _torchrun(tmp_path, ranks: int) -> list[str]:
    """The torchrun command line for ``ranks`` local ranks, its logs under ``tmp_path`` (else it leaves a
    torchelastic_* directory in the system's temporary directory per run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "--log-dir", str(tmp_path / "torchrun-logs")]


def _run(cmd: list[str], device: str = "cpu") -> str:
    """Run ``cmd``; its output. A run where a rank died of SIGSEGV runs once more (warning with the crashed rank's
    stack): once in ten runs of the FSDP2 new-lengths test (in a loaded full suite) a rank crashed so after its
    training steps, the other rank already gathering the final parameters (cause not found; with
    PYTHONFAULTHANDLER the next crash prints where). Every check holds for the run that passes, and a second
    crash fails the test."""
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=HERE, env=_env(device), capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        if done.returncode == 0 or attempt == 2 or "SIGSEGV" not in output:
            break
        start = output.find("Fatal Python error")
        warnings.warn(f"a rank crashed (SIGSEGV) in {' '.join(cmd)}; running it again. Its stack:\n"
                      f"{output[start:start + 4000] if start >= 0 else output[-4000:]}")
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{output[-12000:]}"
    return output


def _train(tmp_path, ranks: int, device: str, model: str, parallel: str, budget: str, autocast: str = "off",
           set_to_none: bool = False, extra: tuple[str, ...] = ()) -> tuple[list[dict], dict, dict | None]:
    """Run the ranks (and, in fp32, one process on the whole batches): (the reports, rank 0's final
    parameters, the single process's or None). Checks that the first step's gradients are bitwise
    those of FSDP2 or DDP alone on the same batches (module docstring)."""
    spread = tmp_path / parallel
    _run([*_torchrun(tmp_path, ranks), str(SCRIPT),
          "--model", model, "--parallel", parallel, "--budget", budget, "--device", device, "--autocast", autocast,
          "--out", str(spread), *(["--set-to-none"] if set_to_none else []), *extra], device)
    grads, plain_grads = torch.load(spread / "grads.pt"), torch.load(spread / "plain_grads.pt")
    assert grads.keys() == plain_grads.keys()
    assert [k for k in grads if not torch.equal(grads[k], plain_grads[k])] == []
    single_params = _single_params(model, device, extra) if autocast == "off" else None
    reports = [json.loads((spread / f"report{r}.json").read_text()) for r in range(ranks)]
    return reports, torch.load(spread / "params.pt"), single_params


#: distributed_train.py's flags that change only what the ranks plan, not one process's plain training
_PLANNING_ONLY_FLAGS = {"--offload": 0, "--meta": 0, "--upcast-outputs": 0, "--block-options": 1}


def _single_params(model: str, device: str, extra: tuple[str, ...]) -> dict:
    """One process's final parameters, trained plainly on the whole global batches (distributed_train.py without
    --parallel). They depend on the model, the device and the steps only, so each is trained once per test session,
    in the session's directory (tests/conftest.py: xdist's workers share it; a file lock on each)."""
    from filelock import FileLock  # (a dependency of torch)

    from conftest import SESSION_DIR_ENV_VAR

    args, i = [], 0
    while i < len(extra):
        values = _PLANNING_ONLY_FLAGS.get(extra[i])  # (how many values the planning-only flag takes)
        if values is None:
            args.append(extra[i])
        i += 1 + (values or 0)
    out = Path(os.environ[SESSION_DIR_ENV_VAR]) / "distributed-single-runs" / "_".join([model, device, *args])
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "report0.json").exists():  # (written last: a run that failed after its parameters is run again)
            _run([sys.executable, str(SCRIPT), "--model", model, "--device", device, "--out", str(out), *args], device)
    return torch.load(out / "params.pt")


def _schedule_part(plan_json: str) -> dict:
    """A rank's plan (ModelPlan JSON) as compared across ranks: its chain, less the seconds its solve took."""
    return {k: v for k, v in json.loads(plan_json)["chain"].items() if k != "solve_seconds"}


def _check(reports, spread_params, single_params, slack: int = 0, recomputes: bool = True) -> hr.ModelPlan:
    """What every run checks (the module docstring); returns rank 0's plan. single_params: None
    under bf16 autocast, where one process's and two ranks' reductions round differently.
    recomputes: whether rank 0's plan must recompute some layer whole (else block options may do it all)."""
    for rank, report in enumerate(reports):
        steady = report["peaks"][-1]
        assert steady <= report["budget"] + slack, (rank, steady, report["budget"])
        assert steady < report["plain_peak"], (rank, steady, report["plain_peak"])
    plan = hr.ModelPlan.from_json(reports[0]["plan"])
    assert not recomputes or max(plan.chain.schedule.forward_counts()[1:-1]) > 1, "some layer must be recomputed"
    chains = [_schedule_part(report["plan"]) for report in reports]
    assert all(chain == chains[0] for chain in chains), "every rank must run rank 0's plan"
    if single_params is not None:
        assert spread_params.keys() == single_params.keys()
        max_abs = max((spread_params[k] - single_params[k]).abs().max().item() for k in spread_params)
        assert max_abs <= ATOL, max_abs
    return plan


def _check_fsdp(reports, sharded_params, single_params, slack: int = 0) -> hr.ModelPlan:
    plan = _check(reports, sharded_params, single_params, slack)
    if all(report["world"] == 1 for report in reports):
        return plan  # (one rank gathers nothing: no FSDP::all_gather events on torch 2.11, CUDA)
    assert all("before fully_shard" in report["sharded_first"] for report in reports)
    assert plan.gathered_stage_bytes and max(plan.gathered_stage_bytes) > 0 and plan.sharded_reserve_bytes > 0
    assert "FSDP2: gathers up to" in reports[0]["summary"]
    # FSDP2 gathers a layer for each of its forwards before the loss and once more for its
    # backward (with the recomputation that precedes it, or prefetched)
    forwards = [0] * plan.chain.schedule.length
    for op in plan.chain.schedule.ops[: plan.chain.schedule.loss_index]:
        forwards[op.stage] += 1
    gathers = reports[0]["all_gathers"]
    layers = [(i, info.name) for i, info in enumerate(plan.stages) if info.name != "(top)"]  # (top): the root's
    assert {name for _, name in layers} == gathers.keys(), (gathers, [info.name for info in plan.stages])
    for i, name in layers:
        assert gathers[name] == forwards[i] + 1, (name, gathers, str(plan.chain.schedule))
    return plan


@pytest.mark.parametrize("model, budget, autocast", [
    ("llama", "3.3MiB", "off"), pytest.param("t5", "3.1MiB", "off", marks=pytest.mark.slow),
])
def test_two_fsdp2_ranks_train_like_one_process_within_budget(tmp_path, model, budget, autocast):
    reports, sharded_params, single_params = _train(tmp_path, 2, "cpu", model, "fsdp", budget, autocast)
    assert all(report["world"] == 2 for report in reports)
    plan = _check_fsdp(reports, sharded_params, single_params)
    assert (plan.chain.costs.residents != ()) == (model == "t5")
    assert plan.chain.autocast.startswith("bf16") == (autocast == "bf16")
    # planned before fully_shard from one run each (its training steps time it, on CPU): solved again from its first
    # sharded step's times at the second, every rank on rank 0's plan (_check)
    assert all("times from its first 1 training steps" in hr.ModelPlan.from_json(report["plan"]).times
               for report in reports), [hr.ModelPlan.from_json(report["plan"]).times for report in reports]


@pytest.mark.slow
def test_two_fsdp2_ranks_count_the_fp32_copies_accelerate_makes_of_the_outputs_after_fully_shard(tmp_path):
    """accelerate's mixed precision wraps the forward to copy its bf16 outputs to fp32 (convert_outputs_to_fp32), and
    accelerator.prepare does it after fully_shard, once remat planned: every rank's plan is re-made for the shards
    with the copies counted (the logits in fp32), together (rank 0's plan on every rank), each step within the
    budget, the first step's gradients bitwise FSDP2 alone's (_train)."""
    pytest.importorskip("accelerate")
    reports, sharded_params, single_params = _train(tmp_path, 2, "cpu", "llama", "fsdp", "3.3MiB", "bf16",
                                                    extra=("--upcast-outputs",))
    plan = _check_fsdp(reports, sharded_params, single_params)
    logits = 4 * 96 * 256 * 4  # (each rank's half of the global batch of 8 x 96: its logits in fp32)
    copies = [hr.ModelPlan.from_json(r["plan"]).output_copies_bytes for r in reports]
    assert copies == [logits] * len(reports) and plan.output_copies_bytes == logits, copies


@pytest.mark.parametrize("autocast", [pytest.param("off", marks=pytest.mark.slow), "bf16"])
def test_two_ddp_ranks_train_a_t5_like_one_process_within_budget(tmp_path, autocast):
    """DDP with its defaults: every parameter's gradient reaches the reducer once per step,
    T5's tied embedding and LM head (read by the first and the last stage) included."""
    reports, ddp_params, single_params = _train(tmp_path, 2, "cpu", "t5", "ddp", "2.5MiB", autocast)
    assert all(report["world"] == 2 for report in reports)
    plan = _check(reports, ddp_params, single_params)
    assert plan.chain.costs.residents != ()


@pytest.mark.parametrize("parallel, model, budget, block_options", [
    pytest.param("ddp", "t5", "2.5MiB", "autograd", marks=pytest.mark.slow),
    pytest.param("fsdp", "llama", "3.15MiB", "autograd", marks=pytest.mark.slow), ("ddp", "llama", "1.8MiB", "ilp"),
])
def test_two_ranks_offloading_train_like_one_process_within_budget(tmp_path, parallel, model, budget, block_options):
    """offload=True under DDP (rank 0's plan, run by every rank with its own disk tier) and FSDP2 (the plan
    re-made for the shards offloads too): parameters those of one process, each rank within the budget.
    Without ILP menus the plans offload checkpoints (x_i); with them (DDP: FSDP2 runs option 0 only), the
    values block options keep (transfers free here: near the smallest feasible budget, 1.53 MiB, sending kept values
    away costs nothing where recomputing a layer does)."""
    reports, params, single_params = _train(tmp_path, 2, "cpu", model, parallel, budget,
                                            extra=("--offload", "--block-options", block_options))
    plan = _check(reports, params, single_params, recomputes=False)
    if block_options == "autograd":
        assert plan.chain.offloads and "offloading: x_" in reports[0]["summary"], reports[0]["summary"]
    else:
        assert any(isinstance(op, OffloadKept) for op in plan.chain.schedule.ops), reports[0]["summary"]
        assert "the values kept by the forwards with grad of stages" in reports[0]["summary"]


@pytest.mark.parametrize("autocast", [pytest.param("off", marks=pytest.mark.slow), "bf16"])
def test_two_fsdp2_ranks_plan_on_meta_then_shard_and_materialize(tmp_path, autocast):
    """torchtitan's order: a Llama built on meta, hr.remat(device=) plans it with lent weights,
    fully_shard per layer and on the root, to_empty, the weights set into the shards, two AdamW steps:
    the first step's gradients bitwise FSDP2 alone's, the parameters one process's, every rank on rank 0's
    plan and within the budget."""
    reports, sharded_params, single_params = _train(tmp_path, 2, "cpu", "llama", "fsdp", "3.3MiB", autocast,
                                                    extra=("--meta",))
    plan = _check_fsdp(reports, sharded_params, single_params)
    assert plan.lent_weight_bytes > 0 and "planned without its weights" in reports[0]["summary"]
    assert plan.chain.autocast.startswith("bf16") == (autocast == "bf16")


def test_two_ddp_ranks_train_varying_lengths_with_default_zero_grad_within_budget(tmp_path):
    """DDP over steps of other sequence lengths (each rank plans each new one on its own: no collective
    in planning), PyTorch's default zero_grad: parameters as one process's, the steady step (a length
    seen before) within the budget on every rank."""
    steps = ("--lengths", "96,64,80", "--steps", "4")  # 96 64 80 96
    reports, ddp_params, single_params = _train(tmp_path, 2, "cpu", "llama", "ddp", "2.6MiB", set_to_none=True,
                                                extra=steps)
    plan = _check(reports, ddp_params, single_params, recomputes=False)
    assert plan.chain.costs.step_grad_bytes and not plan.chain.schedule.keeps_everything
    assert all(report["plans"] == 3 for report in reports)


@pytest.mark.parametrize("autocast", [pytest.param("off", marks=pytest.mark.slow), "bf16"])
def test_two_fsdp2_ranks_plan_new_lengths_after_fully_shard(tmp_path, autocast):
    """Sequence lengths first seen after fully_shard: each is planned without the model's weights (their
    whole shapes, lent weights), then for the shards; every rank runs rank 0's plan at every length, the
    parameters are one process's after steps of 96, 64, 80, 96, 64 and 80 tokens (fp32), and the second step of
    each length is within the budget on every rank, with PyTorch's default zero_grad: every step allocates the
    (sharded) gradients, which each rank's plans count."""
    steps = ("--lengths", "96,64,80", "--steps", "6")
    reports, sharded_params, single_params = _train(tmp_path, 2, "cpu", "llama", "fsdp", "3.6MiB", autocast,
                                                    set_to_none=True, extra=steps)
    plan = _check_fsdp(reports, sharded_params, single_params)
    assert plan.chain.costs.step_grad_bytes
    for report in reports:
        assert report["plans"] == 3
        assert all(peak <= report["budget"] for peak in report["peaks"][3:]), (report["peaks"], report["budget"])
    chains = [[_schedule_part(plan) for plan in report["all_plans"]] for report in reports]
    assert all(chain == chains[0] for chain in chains), "every rank on rank 0's plans"
    assert all(max(gathered, default=0) > 0 for gathered in reports[0]["gathered"]), "each length planned for the shards"


def _failing_fsdp_run(tmp_path, flag: str) -> str:
    """The output of a 2-rank FSDP2 run of 2 steps with ``flag`` (distributed_train.py), which must fail."""
    cmd = [*_torchrun(tmp_path, 2), str(SCRIPT),
           "--model", "llama", "--parallel", "fsdp", "--budget", "3.6MiB", "--device", "cpu", "--steps", "2",
           flag, "--out", str(tmp_path / "fsdp")]
    done = subprocess.run(cmd, cwd=HERE, env=_env("cpu"), capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    return output


@pytest.mark.slow
def test_fsdp2_ranks_called_with_different_lengths_raise_on_every_rank(tmp_path):
    """Under FSDP2 every rank runs one schedule, so every rank must be called with inputs of one shape: where rank 1's
    second batch is shorter than rank 0's, both ranks raise UnsupportedModelError at that call (no rank is left
    waiting in a collective the other never reaches)."""
    output = _failing_fsdp_run(tmp_path, "--uneven")
    assert output.count("every rank must be called with inputs of the same shapes") >= 2, output[-6000:]
    assert "rank 0 and rank 1 differ" in output


def test_fsdp2_ranks_raise_together_where_one_has_no_plan_and_on_new_shape_is_error(tmp_path):
    """With on_new_shape="error", a rank without a plan for the call's shape (rank 1's forgotten, as if evicted: the
    ranks' plans differ where their padding states do) makes every rank raise at that call, not that rank alone
    while the other waits in FSDP2's all-gathers."""
    output = _failing_fsdp_run(tmp_path, "--refuse")
    assert output.count("from the planned ones on another rank") >= 1, output[-6000:]
    assert output.count("from the planned ones; call hierremat.remat") >= 1, output[-6000:]


@pytest.mark.cuda
def test_cuda_fsdp2_trains_like_one_process_within_budget(tmp_path):
    """One FSDP2 rank (nccl) on the GPU: the hooks, the re-plan and the accounting on CUDA. (One rank holds
    every parameter and its gradient: its floor on an H200 was 6.98 MiB.)"""
    reports, sharded_params, single_params = _train(tmp_path, 1, "cuda", "llama", "fsdp", "7.5MiB")
    _check_fsdp(reports, sharded_params, single_params, slack=512 * 64)  # the allocator rounds blocks up to 512 bytes
