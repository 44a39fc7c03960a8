"""Hugging Face conventions: what ``hierremat.remat`` does for a ``transformers`` model.

* **No KV cache in training.** A decoder returns its key/value cache by default
  (``config.use_cache``), which is useless in training and ties every layer's keys and
  values to the output. Hugging Face's own gradient checkpointing turns it off in
  training (``use_cache=False``, with one warning); so does hierremat: for a model in
  training mode whose ``forward`` takes ``use_cache``, every call (the example call that
  is captured, and each call of the returned module) gets ``use_cache=False``, and one
  line is logged.
* **Masks as in eager mode.** Under ``torch.export`` Hugging Face's mask code never skips a
  mask (``is_torchdynamo_exporting()``), so that an exported program does not hard-code
  ``is_causal`` for other sequence lengths. A captured plan is specialised to its call's
  shapes, so capture lets the mask code take the decisions it takes in eager mode where
  they depend on shapes alone (:func:`eager_mask_decisions`); decisions that read a
  mask's values still see a traced tensor and keep the mask. Without this, T5's decoder
  adds its position bias to a causal mask materialised over the batch, and its bias
  gradient is summed over the batch after SDPA's bf16 rounding instead of before it: not
  bitwise under bf16 autocast.
* **Cache objects in outputs** (a model in eval mode, or one called with a cache) are
  flattened with the pytree support ``transformers`` ships for ``torch.export``
  (``register_dynamic_cache_export_support``), so capture does not refuse them.
* **Outputs copied to fp32.** accelerate's mixed precision (``Accelerator.prepare`` with fp16 or
  bf16, as the Trainer's ``bf16=True`` and ``fp16=True`` run it) wraps the model's ``forward`` so that
  every fp16/bf16 tensor it returns is copied to fp32 after it (``convert_outputs_to_fp32``): the
  logits' copy is twice their bytes, beside the model's (:func:`upcasts_outputs`).

Nothing here imports ``transformers`` unless the model is one of its models.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Iterator

import torch

from ..session import current_session

log = logging.getLogger(__name__)


def upcasts_outputs(module: torch.nn.Module) -> bool:
    """Whether ``module``'s ``forward`` is wrapped by accelerate's mixed precision (module docstring): its
    ``ConvertOutputsToFp32`` found along the wrappers (``__func__`` of a bound method, ``__wrapped__``)."""
    forward = module.__dict__.get("forward")
    for _ in range(8):  # (a few wrappers deep: autocast's, the conversion's, a bound method)
        if forward is None:
            return False
        kind = type(forward)
        if kind.__name__ == "ConvertOutputsToFp32" and kind.__module__.startswith("accelerate"):
            return True
        forward = getattr(forward, "__func__", None) or getattr(forward, "__wrapped__", None)
    return False


def is_transformers_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (checked without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(model).__mro__
    )


def _takes_use_cache(model: torch.nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _transformers_model_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The ``transformers`` model ``model`` is, or wraps as a PEFT model (``get_base_model()``)."""
    if is_transformers_model(model):
        return model
    base = getattr(model, "get_base_model", None)
    if callable(base):
        inner = base()
        if isinstance(inner, torch.nn.Module) and is_transformers_model(inner):
            return inner
    return None


def call_kwargs(model: torch.nn.Module, kwargs: dict) -> dict:
    """The keyword arguments hierremat captures and calls ``model`` with: ``use_cache=False``
    added for a ``transformers`` model (or a PEFT model wrapping one) in training whose
    forward takes it (module docstring)."""
    inner = _transformers_model_of(model)
    if inner is None or not model.training or not _takes_use_cache(inner):
        return kwargs
    if kwargs.get("use_cache") is False:
        return kwargs
    _log_use_cache_off(type(model).__name__, kwargs.get("use_cache"))
    return {**kwargs, "use_cache": False}


def _log_use_cache_off(model_name: str, given) -> None:
    if not current_session().first_time(("use_cache off", model_name, given)):
        return
    if given is True:
        log.warning("%s: use_cache=True is incompatible with rematerialization in training; using use_cache=False "
                    "(as Hugging Face's gradient checkpointing does)", model_name)
    else:
        log.info("%s in training: use_cache=False (no key/value cache is built, as with Hugging Face's gradient "
                 "checkpointing)", model_name)


def register_cache_pytrees(model: torch.nn.Module) -> None:
    """Let torch.export flatten ``transformers`` cache objects (for models that return one)."""
    if _transformers_model_of(model) is None:
        return
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:  # an older transformers: capture names the type if a cache is returned
        return
    register_dynamic_cache_export_support()


@contextmanager
def eager_mask_decisions(model: torch.nn.Module) -> Iterator[None]:
    """While capturing a ``transformers`` model: its mask code decides as in eager mode (module docstring)."""
    masking = None
    if _transformers_model_of(model) is not None:
        try:
            from transformers import masking_utils as masking
        except ImportError:  # an older transformers: masks are built in each model's code
            pass
    if masking is None or not hasattr(masking, "is_torchdynamo_exporting"):
        yield
        return
    exporting = masking.is_torchdynamo_exporting
    masking.is_torchdynamo_exporting = lambda: False
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = exporting
