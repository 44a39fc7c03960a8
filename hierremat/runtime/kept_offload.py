"""The values a block option's tape keeps, sent to the second tier and brought back.

A schedule's ``Offload_kept(i)`` follows ``F_all(i, k)`` where option k is a block option: its forward
returned what it keeps as a list (hierremat.runtime.block_exec.OptionTape), so each value can leave the
device while the later stages run and come back before ``B(i)`` (``Fetch_kept(i)``), as a checkpointed
activation does (Beaumont, Eyraud-Dubois and Shilova, NeurIPS 2021; per value, POET's paging, Patil et al.,
ICML 2022).

What moves is each kept *storage*, whole and once: kept values that view one storage come back viewing one
storage again, with their dtypes, offsets, sizes and strides, so the bytes on the device when they are back
are the bytes the option's kept count measured. The stage's input goes too where the option pins it and the
plan says nothing else holds it (``with_input``: hierremat.plans.transfers.TransferPlan.kept_offloaded). A storage
that something outside the tape also holds stays: the stage's output (an option that pins it), its parameters and
buffers, and what it reads beside x (``others``); sending it would free nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_exec import OptionTape


@dataclass(frozen=True)
class KeptView:
    """One kept value as a view of its storage: its place in the tape (an index of ``kept``, or ``"x"`` for the
    pinned input), dtype, storage offset (elements of its dtype), size and stride."""

    slot: int | str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class AwayStorage:
    """One kept storage in the second tier: its key there and the kept values that view it."""

    key: tuple
    views: tuple[KeptView, ...]


def send_kept(tier, key: tuple, tape: OptionTape, others, with_input: bool = False) -> tuple[AwayStorage, ...]:
    """Send the storages of ``tape.kept`` (and of ``tape.x`` if ``with_input``) that no tensor of ``others`` shares
    to ``tier`` (keys ``(*key, n)``), wait until each is copied out, and drop the tape's references (their device
    memory is freed then): their places in the tape become None until :func:`bring_back_kept`."""
    values = dict(enumerate(tape.kept))
    if with_input and tape.x is not None:
        values["x"] = tape.x
    held = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
    slots_of: dict[int, list] = {}
    for slot, value in values.items():
        if not isinstance(value, torch.Tensor) or value.untyped_storage().nbytes() == 0:
            continue
        where = value.untyped_storage().data_ptr()
        if where not in held:
            slots_of.setdefault(where, []).append(slot)
    away = []
    try:
        for n, slots in enumerate(slots_of.values()):
            first = values[slots[0]]
            data = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
            views = tuple(
                KeptView(j, values[j].dtype, values[j].storage_offset(), tuple(values[j].shape),
                         tuple(values[j].stride()))
                for j in slots
            )
            tier.offload((*key, n), data)
            away.append(AwayStorage((*key, n), views))
            del data, first
        for stored in away:
            tier.wait_offloaded(stored.key)
    except BaseException:
        for stored in away:
            tier.discard(stored.key)
        raise
    del values
    for stored in away:
        for view in stored.views:
            _put(tape, view.slot, None)
    return tuple(away)


def _put(tape: OptionTape, slot: int | str, value: torch.Tensor | None) -> None:
    if slot == "x":
        tape.x = value
    else:
        tape.kept[slot] = value


def prefetch_kept(tier, away: tuple[AwayStorage, ...]) -> None:
    """Start bringing the storages of ``away`` back."""
    for stored in away:
        tier.prefetch(stored.key)


def bring_back_kept(tier, away: tuple[AwayStorage, ...], tape: OptionTape) -> None:
    """Fetch the storages of ``away`` and put their views back in ``tape.kept``."""
    for stored in away:
        data = tier.fetch(stored.key)
        if data.storage_offset():
            data = data.clone()
        storage = data.untyped_storage()
        del data
        for view in stored.views:
            _put(tape, view.slot, torch.empty(0, dtype=view.dtype, device=storage.device).set_(
                storage, view.offset, view.size, view.stride))
        del storage
