"""The cyclic garbage collector is paused while a shape is planned from its family's symbolic capture
(hierremat.api.collector): no collection runs inside that planning, the collector is on again after it, as the
caller had it, also where planning raises; a family's first shape (profiled, its block options solved) and a shape
planned again to build its block options plan with the collector as it was."""

from __future__ import annotations

import gc

import pytest
import torch

import hierremat as hr
from hierremat.api import whole_model
from hierremat.api.collector import collector_paused

from models import padded_batch, tiny_gpt2


@pytest.fixture
def collector_on():
    enabled = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if enabled else gc.disable)()


def test_paused_then_restored_as_the_caller_had_it(collector_on):
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("planning failed")
    assert gc.isenabled()
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # (the caller's choice kept)


def test_a_new_length_is_planned_with_the_collector_paused_and_no_collection_inside(collector_on, monkeypatch):
    planning: list[dict] = []
    real_compile = whole_model.plan_shape

    def plan_shape(*args, **kwargs):
        record = {"enabled": gc.isenabled(), "collections": []}
        planning.append(record)
        try:
            return real_compile(*args, **kwargs)
        finally:
            record["done"] = True

    def on_collection(phase, info):
        if phase == "start" and planning and "done" not in planning[-1]:
            planning[-1]["collections"].append(info["generation"])

    monkeypatch.setattr(whole_model, "plan_shape", plan_shape)
    gc.callbacks.append(on_collection)
    try:
        torch.manual_seed(0)
        model = tiny_gpt2(n_layer=2)
        example = padded_batch(48, pad=3, vocab_size=256)  # (padded: the sizes vary, captured symbolically at once)
        module = hr.remat(model, (), example, budget="64MiB", settings=hr.Settings(cache=False))
        for length in (40, 33):
            batch = padded_batch(length, pad=2, vocab_size=256)
            module(**batch).loss.backward()
            assert gc.isenabled()
        key = next(reversed(module._planned))  # (planned again to build its block options: seconds, not paused)
        module._plan_again(key, (), batch, defer_blocks=False)
    finally:
        gc.callbacks.remove(on_collection)
    assert [c.plan.capture_kind for c in module._planned.values()] == ["specialized"] * 3  # (one symbolic capture)
    assert planning[0]["enabled"]  # (the first shape: profiled, its block options solved, with the collector on)
    assert [p["enabled"] for p in planning[1:]] == [False, False, True]
    assert all(p["collections"] == [] for p in planning[1:3]), planning
