"""Hugging Face's Trainer with its default arguments trains a remat'd model.

Trainer keeps the dataset columns the model's forward names (``remove_unused_columns=True``), reads
``config`` and ``main_input_name`` from the model, calls PyTorch's default ``zero_grad`` (every
``.grad`` None between steps) and, with dynamic padding, sees a new length in many batches.
"""

import copy
import inspect
import logging

import pytest
import torch

import hierremat as hr
from hierremat.device import LiveTensorTracker

from models import tiny_gpt2

transformers = pytest.importorskip("transformers")

LENGTHS = (12, 20, 12, 20, 20, 12, 12, 20)


class Rows(torch.utils.data.Dataset):
    """Token rows of several lengths, with a text column the model does not take."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(1, 256, (n,), generator=g).tolist() for n in LENGTHS]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i], "text": f"row {i}"}


def pad_to_longest(features):
    """Dynamic padding, as DataCollatorWithPadding does: each batch as long as its longest row;
    padding masked out of the attention and of the loss (-100)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n] = torch.tensor(f["input_ids"])
        mask[row, :n] = 1
        labels[row, :n] = torch.tensor(f["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture
def mixed_precision_undone(monkeypatch):
    """A test that trains in mixed precision starts from no accelerate state and leaves none behind:
    TrainingArguments(bf16=True) sets ACCELERATE_MIXED_PRECISION in the environment, and accelerate keeps its state
    per process (a later ``Accelerator(cpu=True)`` would run in bf16; an ``Accelerator(mixed_precision=...)`` after
    another refuses to change it)."""
    accelerate = pytest.importorskip("accelerate")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # (put back as it was after the test)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # (one an earlier test left)
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


class MeasuredTrainer(transformers.Trainer):
    """Trainer recording the live-tensor peak of each training step (forward and backward)."""

    peaks: list

    def training_step(self, *args, **kwargs):
        with LiveTensorTracker() as tracker:
            loss = super().training_step(*args, **kwargs)
        self.peaks.append(tracker.peak_bytes)
        return loss


def _train(model, tmp_path, name, steps: int = 4, resume: bool = False, **arguments):
    """Train to ``steps`` (from the checkpoint Trainer saved at the end of the last run, ``resume``); ``arguments``:
    more TrainingArguments."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=2,
                                          logging_steps=1, report_to=[], seed=0, **arguments)
    trainer = MeasuredTrainer(model=model, args=args, train_dataset=Rows(), data_collator=pad_to_longest)
    trainer.peaks = []
    trainer.train(resume_from_checkpoint=resume or None)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer.peaks


def test_trainer_with_default_arguments_trains_exactly_within_the_budget(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=64)
    reference = copy.deepcopy(model)
    example = pad_to_longest([Rows()[1], Rows()[2]])  # the longest length, one row padded
    ids = example.pop("input_ids")
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), example, budget="1KiB")
    budget = err.value.min_budget_bytes
    module = hr.remat(model, (ids,), example, budget=f"{budget}B")
    assert inspect.signature(module.forward) == inspect.signature(model.forward)
    assert module.config is model.config and module.main_input_name == "input_ids"
    assert list(module.state_dict()) == list(model.state_dict())

    plain_losses, _ = _train(reference, tmp_path, "plain")
    losses, peaks = _train(module, tmp_path, "remat")  # saves a checkpoint at the end, as by default
    assert len(losses) == 4 and losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert max(peaks) <= budget, (peaks, budget)
    assert all(p.grad is None for p in model.parameters())  # Trainer's zero_grad: the step allocates them
    assert any(plan.chain.costs.step_grad_bytes for plan in module.plans)

    # resume from the checkpoints on fresh models: two more steps, as plain Trainer resumes
    torch.manual_seed(0)
    fresh, fresh_reference = tiny_gpt2(n_layer=2, n_embd=64), tiny_gpt2(n_layer=2, n_embd=64)
    plain_more, _ = _train(fresh_reference, tmp_path, "plain", steps=6, resume=True)
    more, peaks = _train(hr.remat(fresh, (ids,), example, budget=f"{budget}B"), tmp_path, "remat", steps=6, resume=True)
    assert len(more) == 6 and more[:4] == losses and more == plain_more  # (the log restored with the state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), fresh_reference.state_dict().values()))
    assert max(peaks) <= budget


@pytest.mark.slow
def test_trainer_bf16_plans_for_its_fp32_outputs_and_autocast_recipe_exactly_within_the_budget(
        tmp_path, caplog, mixed_precision_undone):
    """``bf16=True``: accelerate runs the forward under autocast, copies the bf16 logits to fp32 after it
    (``convert_outputs_to_fp32``), and Trainer runs the backward outside autocast. remat, planned under autocast
    before Trainer wrapped it (and moved it: planned again), plans the first call with the copies held beside the chain (a budget without
    room for them raises, saying so), then again once the first backward shows the recipe: block options for GPT-2's
    blocks (attention with dropout: a backward autocast changes). The weights stay bitwise plain Trainer's, the steps
    after planning within the budget."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=64)
    reference = copy.deepcopy(model)
    example = pad_to_longest([Rows()[1], Rows()[2]])  # (every batch of Rows pads to this length)
    ids = example.pop("input_ids")
    copies = 4 * ids.numel() * model.config.vocab_size  # the logits in fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (planned under the autocast it trains with, as usage.md says)
        # the smallest budget while the recipe is not known (no block options for GPT-2's blocks): the first call's
        with pytest.raises(hr.InfeasibleBudgetError) as err:
            hr.remat(copy.deepcopy(model), (ids,), example, budget="1KiB",
                     settings=hr.Settings(cache=False, defer_block_options=False))
        short = hr.remat(copy.deepcopy(model), (ids,), example, budget=f"{err.value.min_budget_bytes}B",
                         settings=hr.Settings(cache=False, defer_block_options=False))  # (block options solved when planned: the recipe's, under test)
        module = hr.remat(model, (ids,), example, budget=f"{err.value.min_budget_bytes + copies}B",
                          settings=hr.Settings(cache=False, defer_block_options=False))
    assert module.plans[0].stages[1].signature not in module.plans[0].menus  # the recipe not known yet
    with pytest.raises(hr.InfeasibleBudgetError, match="fp32 copies the caller makes"):
        _train(short, tmp_path, "short", bf16=True, use_cpu=True)
    _train(reference, tmp_path, "plain", bf16=True, use_cpu=True)
    with caplog.at_level(logging.INFO, logger="hierremat"):
        _, peaks = _train(module, tmp_path, "remat", bf16=True, use_cpu=True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert caplog.text.count("the backward runs outside autocast") == 1
    plan = module.plans[-1]
    assert plan.output_copies_bytes == copies and plan.chain.autocast == "bf16 on cpu" and plan.backward_autocast is False
    assert plan.stages[1].signature in plan.menus and "all[" in plan.summary()  # a block option runs
    budget = module.budget_bytes
    assert max(peaks[2:]) <= budget, (peaks, budget)  # (the first two steps plan: for the copies, for the recipe)


def test_accelerate_prepare_and_loop_train_exactly_within_the_budget():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=64)
    reference = copy.deepcopy(model)
    example = pad_to_longest([Rows()[1], Rows()[2]])
    ids = example.pop("input_ids")
    with pytest.raises(hr.InfeasibleBudgetError) as err:
        hr.plan(model, (ids,), example, budget="1KiB")
    budget = err.value.min_budget_bytes
    runs = []
    for net in (reference, hr.remat(model, (ids,), example, budget=f"{budget}B")):
        accelerator = accelerate.Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(Rows(), batch_size=2, collate_fn=pad_to_longest)
        net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        losses, peaks = [], []
        torch.manual_seed(1)
        for batch in loader:
            with LiveTensorTracker() as tracker:
                loss = net(**batch).loss
                accelerator.backward(loss)
            peaks.append(tracker.peak_bytes)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, peaks))
    (plain_losses, _), (losses, peaks) = runs
    assert losses == plain_losses and max(peaks) <= budget, (peaks, budget)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


@pytest.mark.slow
def test_a_plan_made_before_accelerate_copies_the_outputs_to_fp32_is_made_again(caplog, mixed_precision_undone):
    """accelerate's mixed precision wraps the forward of a model remat planned already (here without moving it, as
    ``device_placement=False`` prepares it): the next call plans again with the fp32 copies counted; gradients stay
    plain's under the same wrapper. A saved plan (``plan=``) is run as it is, warned about."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=2, n_embd=64)
    reference = copy.deepcopy(model)
    batch = pad_to_longest([Rows()[1], Rows()[2]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module = hr.remat(model, (), batch, budget="64MiB", settings=hr.Settings(cache=False, backward_autocast=False))
    assert module.plans[0].output_copies_bytes == 0
    runs = []
    for net in (reference, module):
        net = accelerate.Accelerator(cpu=True, mixed_precision="bf16", device_placement=False).prepare(net)
        with caplog.at_level(logging.INFO, logger="hierremat"):
            torch.manual_seed(1)
            out = net(**batch)
        assert out.logits.dtype == torch.float32  # (accelerate's copy)
        out.loss.backward()
        runs.append([p.grad for p in (reference if net is not module else model).parameters()])
    assert caplog.text.count("now copied to fp32 by the caller") == 1
    assert module.plans[-1].output_copies_bytes == 4 * batch["input_ids"].numel() * model.config.vocab_size
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # a saved plan is never made again: warned about once
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = hr.remat(model, (), batch, plan=hr.plan(model, (), batch, budget="64MiB",
                                                        settings=hr.Settings(cache=False, backward_autocast=False)))
    saved = accelerate.Accelerator(cpu=True, mixed_precision="bf16", device_placement=False).prepare(saved)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hierremat"):
        for _ in range(2):
            saved(**batch).loss.backward()
    assert caplog.text.count("the saved plan does not count the copies") == 1
