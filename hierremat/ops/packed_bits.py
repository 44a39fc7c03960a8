"""Bit-packed boolean masks: the ``hierremat::`` operators and their kernels.

Operators (schemas defined here with ``torch.library``):

* ``pack_mask(Tensor mask) -> Tensor``: a bool mask of n elements as ``ceil(n / 8)`` uint8
  bytes, element i at bit ``i % 8`` of byte ``i // 8`` (logical, row-major element order).
* ``masked_scale(Tensor x, Tensor bits, float scale) -> Tensor``: ``x.mul(mask).mul_(scale)``
  with the mask read from ``bits``: bitwise ``native_dropout``'s output for its input and
  mask, and ``native_dropout_backward`` for the output gradient.
* ``dropout_bits(Tensor x, float p) -> Tensor`` (tagged ``nondeterministic_seeded``): the
  packed mask ``native_dropout(x, p, train=True)`` would draw, drawing the same random
  numbers (on CPU the mask alone is drawn, by the same ``bernoulli_`` call; elsewhere
  ``native_dropout`` itself runs and its output is dropped).
* ``above_bits(Tensor x, float threshold) -> Tensor``: the packed mask ``!(x <= threshold)``
  (the elements ``threshold_backward(grad, x, threshold)`` lets through; NaN passes);
* ``where_bits(Tensor x, Tensor bits) -> Tensor``: ``x`` where the mask is set, +0 elsewhere, in
  ``x``'s layout: bitwise ``threshold_backward(x, self, threshold)`` given ``above_bits(self,
  threshold)`` (the ReLU variant, hierremat.blocks.variants.relu_masks), except a 16-bit NaN's
  payload, which ATen's kernel changes on its way through fp32 and this one keeps.
* ``masked_scale.out`` and ``where_bits.out`` (``*, Tensor(a!) out``): the same, written into
  ``out``, which may be ``x`` itself (each element is read before it is written): the in-place
  forms hierremat.blocks.variants.in_place uses where nothing reads ``x`` after.

Kernels: the CPU ones are C++ (``csrc/packed_bits.cpp``), compiled on first use with
``torch.utils.cpp_extension`` (needs a C++ compiler and ninja; the build is cached by
torch); the CUDA ones are Triton (hierremat.ops.triton_kernels, compiled by Triton on
first use; fp16/bf16/fp32 contiguous tensors); every device also has the pure-torch
reference below, which runs where the extension or Triton cannot be used (logged once), for
other dtypes and layouts, or everywhere with ``HIERREMAT_NO_EXTENSION=1``. All compute the
same bits, checked by tests/test_variants.py (the Triton kernels through Triton's
interpreter on CPU, and on CUDA under ``pytest.mark.cuda``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from .bit_layout import packed_size

log = logging.getLogger(__name__)

_LIBRARY = torch.library.Library("hierremat", "DEF")
_LIBRARY.define("pack_mask(Tensor mask) -> Tensor")
_LIBRARY.define("masked_scale(Tensor x, Tensor bits, float scale) -> Tensor")
_LIBRARY.define("dropout_bits(Tensor x, float p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.define("above_bits(Tensor x, float threshold) -> Tensor")
_LIBRARY.define("where_bits(Tensor x, Tensor bits) -> Tensor")
_LIBRARY.define("masked_scale.out(Tensor x, Tensor bits, float scale, *, Tensor(a!) out) -> Tensor(a!)")
_LIBRARY.define("where_bits.out(Tensor x, Tensor bits, *, Tensor(a!) out) -> Tensor(a!)")

_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "packed_bits.cpp"
# OpenMP: ATen's parallel_for runs serially in an extension built without it
_CFLAGS, _LDFLAGS = ("-O3", "-fopenmp"), ("-fopenmp",)
#: seconds a first build of the kernels may take before the pure-torch kernels are used instead
BUILD_TIMEOUT_SECONDS = 1800


@functools.cache
def _shifts(device: torch.device) -> torch.Tensor:
    """0..7 on ``device``, made once per device (a constant: every mask packed or unpacked reads it)."""
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_mask_reference(mask: torch.Tensor) -> torch.Tensor:
    """The pure-torch ``pack_mask``."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) << _shifts(mask.device)).sum(1, dtype=torch.uint8)


def unpack_mask(bits: torch.Tensor, shape) -> torch.Tensor:
    """The bool mask of ``shape`` packed in ``bits``."""
    numel = math.prod(int(d) for d in shape)
    flat = (bits.unsqueeze(1) >> _shifts(bits.device)) & 1
    return flat.view(-1)[:numel].view(tuple(shape)).to(torch.bool)


def masked_scale_reference(x: torch.Tensor, bits: torch.Tensor, scale: float) -> torch.Tensor:
    """The pure-torch ``masked_scale``."""
    return x.mul(unpack_mask(bits, x.shape)).mul_(scale)


def above_bits_reference(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The pure-torch ``above_bits`` (the comparison in x's dtype, as threshold_backward's)."""
    return pack_mask_reference(torch.le(x, threshold).logical_not_())


def where_bits_reference(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The pure-torch ``where_bits``."""
    return where_bits_out_reference(x, bits, out=torch.empty_like(x))


def masked_scale_out_reference(x: torch.Tensor, bits: torch.Tensor, scale: float, *, out: torch.Tensor) -> torch.Tensor:
    """The pure-torch ``masked_scale.out`` (``out`` may be ``x``: ATen's pointwise kernels allow it)."""
    return torch.mul(x, unpack_mask(bits, x.shape), out=out).mul_(scale)


def where_bits_out_reference(x: torch.Tensor, bits: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """The pure-torch ``where_bits.out`` (``out`` may be ``x``)."""
    return torch.where(unpack_mask(bits, x.shape), x, x.new_zeros(()), out=out)


@functools.cache
def _cpu_bernoulli_is_native_dropouts() -> bool:
    """Whether ``empty_like(x, bool).bernoulli_(1 - p)`` draws ``native_dropout``'s CPU mask
    (checked once on a small tensor, the global RNG state restored)."""
    x = torch.ones(1000)
    with torch.random.fork_rng(devices=[]):
        state = torch.get_rng_state()
        _, mask = torch.ops.aten.native_dropout(x, 0.3, True)
        after_native = torch.get_rng_state()
        torch.set_rng_state(state)
        drawn = torch.empty_like(x, dtype=torch.bool).bernoulli_(0.7)
        same = torch.equal(drawn, mask) and torch.equal(torch.get_rng_state(), after_native)
    if not same:
        log.warning("this torch's native_dropout draws its CPU mask differently; dropout_bits runs native_dropout itself")
    return same


def _dropout_bits(x: torch.Tensor, p: float) -> torch.Tensor:
    if x.device.type == "cpu" and _cpu_bernoulli_is_native_dropouts():
        mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
    else:
        mask = torch.ops.aten.native_dropout(x, p, True)[1]
    return torch.ops.hierremat.pack_mask(mask)


def _register(kernels: dict, dispatch_key: str) -> None:
    for name, kernel in kernels.items():
        torch.library.impl(_LIBRARY, name, dispatch_key)(kernel)


_register({
    "pack_mask": pack_mask_reference, "masked_scale": masked_scale_reference, "dropout_bits": _dropout_bits,
    "above_bits": above_bits_reference, "where_bits": where_bits_reference,
    "masked_scale.out": masked_scale_out_reference, "where_bits.out": where_bits_out_reference,
}, "CompositeExplicitAutograd")


@functools.cache
def cuda_kernels():
    """hierremat.ops.triton_kernels, or None, with one log line saying why, where Triton
    cannot be imported or ``HIERREMAT_NO_EXTENSION`` is set (the reference kernels run instead)."""
    if os.environ.get("HIERREMAT_NO_EXTENSION"):
        log.info("HIERREMAT_NO_EXTENSION is set: CUDA variants use the pure-torch kernels")
        return None
    try:
        from . import triton_kernels
    except ImportError as err:
        log.warning("Triton is not importable (%s): CUDA variants use the pure-torch kernels", err)
        return None
    return triton_kernels


def _check_bits(x: torch.Tensor, bits: torch.Tensor) -> None:
    if bits.dtype != torch.uint8 or bits.numel() != packed_size(x.numel()):
        raise ValueError(f"bits: expected {packed_size(x.numel())} uint8 bytes for {x.numel()} elements, "
                         f"got {bits.numel()} of {bits.dtype}")


def _kernels_for(x: torch.Tensor, *others: torch.Tensor, out: torch.Tensor | None = None):
    """The Triton kernels where they take floating ``x`` (with ``others`` and an ``out`` of x's
    shape and dtype), else None: the reference runs."""
    kernels = cuda_kernels()
    if kernels is None or not x.is_floating_point():
        return None
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        return None
    tensors = (x, *others) if out is None else (x, *others, out)
    return kernels if kernels.supports(*tensors) else None


def _pack_mask_cuda(mask: torch.Tensor) -> torch.Tensor:
    kernels = cuda_kernels()
    if kernels is None or not mask.is_contiguous():
        return pack_mask_reference(mask)
    return kernels.pack_mask(mask)


def _above_bits_cuda(x: torch.Tensor, threshold: float) -> torch.Tensor:
    kernels = _kernels_for(x)
    if kernels is None:
        return above_bits_reference(x, threshold)
    return kernels.above_bits(x, threshold)


def _masked_scale_out_cuda(x: torch.Tensor, bits: torch.Tensor, scale: float, *, out: torch.Tensor) -> torch.Tensor:
    _check_bits(x, bits)
    kernels = _kernels_for(x, bits, out=out)
    if kernels is None:
        return masked_scale_out_reference(x, bits, scale, out=out)
    return kernels.masked_scale_out(x, bits, scale, out)


def _masked_scale_cuda(x: torch.Tensor, bits: torch.Tensor, scale: float) -> torch.Tensor:
    if not x.is_contiguous():
        return masked_scale_reference(x, bits, scale)
    return _masked_scale_out_cuda(x, bits, scale, out=torch.empty_like(x))


def _where_bits_out_cuda(x: torch.Tensor, bits: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    _check_bits(x, bits)
    kernels = _kernels_for(x, bits, out=out)
    if kernels is None:
        return where_bits_out_reference(x, bits, out=out)
    return kernels.where_bits_out(x, bits, out)


def _where_bits_cuda(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    return _where_bits_out_cuda(x, bits, out=torch.empty_like(x))


# (dropout_bits on CUDA: native_dropout's own mask, packed by the pack_mask kernel)
_register({
    "pack_mask": _pack_mask_cuda, "above_bits": _above_bits_cuda, "masked_scale": _masked_scale_cuda,
    "where_bits": _where_bits_cuda, "masked_scale.out": _masked_scale_out_cuda, "where_bits.out": _where_bits_out_cuda,
}, "CUDA")


@torch.library.register_fake("hierremat::pack_mask", lib=_LIBRARY)
def _pack_mask_fake(mask):
    return mask.new_empty((packed_size(mask.numel()),), dtype=torch.uint8)


@torch.library.register_fake("hierremat::masked_scale", lib=_LIBRARY)
def _masked_scale_fake(x, bits, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("hierremat::dropout_bits", lib=_LIBRARY)
def _dropout_bits_fake(x, p):
    return x.new_empty((packed_size(x.numel()),), dtype=torch.uint8)


@torch.library.register_fake("hierremat::above_bits", lib=_LIBRARY)
def _above_bits_fake(x, threshold):
    return x.new_empty((packed_size(x.numel()),), dtype=torch.uint8)


@torch.library.register_fake("hierremat::where_bits", lib=_LIBRARY)
def _where_bits_fake(x, bits):
    return torch.empty_like(x)


@torch.library.register_fake("hierremat::masked_scale.out", lib=_LIBRARY)
def _masked_scale_out_fake(x, bits, scale, *, out):
    return out


@torch.library.register_fake("hierremat::where_bits.out", lib=_LIBRARY)
def _where_bits_out_fake(x, bits, *, out):
    return out


def _masked_scale_setup(ctx, inputs, output) -> None:
    _, bits, scale = inputs
    ctx.save_for_backward(bits)
    ctx.scale = scale


def _masked_scale_backward(ctx, grad):
    """``masked_scale`` is linear in x: its gradient is ``masked_scale`` of the output gradient
    (bitwise ``native_dropout_backward``)."""
    (bits,) = ctx.saved_tensors
    return torch.ops.hierremat.masked_scale(grad, bits, ctx.scale), None, None


torch.library.register_autograd(
    "hierremat::masked_scale", _masked_scale_backward, setup_context=_masked_scale_setup, lib=_LIBRARY
)


#: A build lock older than this many seconds is taken as left by a build that was killed (a build takes under a
#: minute): torch's own wait for it never ends.
STALE_LOCK_SECONDS = 600


def extension_name() -> str:
    """The kernels' build name, one per torch release, source and flags: a library built against another torch's
    headers, or from another source, is never loaded."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + repr((_CFLAGS, _LDFLAGS)).encode()).hexdigest()[:12]
    return f"hierremat_packed_bits_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}_{digest}"


def _remove_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, a build lock left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _build(name: str) -> None:
    """Build the kernels as ``name`` (torch.utils.cpp_extension.load) in a child process. Where ninja is not on
    PATH, the child's PATH starts with this interpreter's scripts, where pip put ninja (a dependency): an
    interpreter run by path need not have them on PATH. Raises RuntimeError with the line that says what failed."""
    env = dict(os.environ)
    if shutil.which("ninja") is None:
        env["PATH"] = sysconfig.get_path("scripts") + os.pathsep + env.get("PATH", "")
    code = ("import json, sys; from torch.utils import cpp_extension; name, source, cflags, ldflags = sys.argv[1:]; "
            "cpp_extension.load(name=name, sources=[source], is_python_module=False, verbose=False, "
            "extra_cflags=json.loads(cflags), extra_ldflags=json.loads(ldflags))")
    args = [sys.executable, "-c", code, name, str(_SOURCE), json.dumps(_CFLAGS), json.dumps(_LDFLAGS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
    if done.returncode != 0:  # (the line before ninja's last says what failed: a compiler error, say)
        lines = [line for line in (done.stderr + done.stdout).splitlines()
                 if line.strip() and not line.startswith("ninja: build stopped")]
        raise RuntimeError(f"building {name} failed: {lines[-1] if lines else f'exit status {done.returncode}'}")


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first time on this machine) and load the C++ CPU kernels; False, with one
    log line saying why, when they cannot be used (the reference kernels run instead)."""
    if os.environ.get("HIERREMAT_NO_EXTENSION"):
        log.info("HIERREMAT_NO_EXTENSION is set: packed masks use the pure-torch kernels")
        return False
    if not _SOURCE.exists():
        log.warning("%s is missing (hierremat installed without csrc/): packed masks use the pure-torch kernels", _SOURCE)
        return False
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        build = Path(cpp_extension._get_build_directory(name, verbose=False))
        _remove_stale_lock(build / "lock")
        library = build / f"{name}{cpp_extension.LIB_EXT}"
        if not library.exists() or (build / "lock").exists():  # (a lock: another process is building it)
            _build(name)
            torch.ops.load_library(str(library))
        else:
            try:
                torch.ops.load_library(str(library))
            except OSError:  # (a library a killed build left unfinished: built again)
                library.unlink(missing_ok=True)
                _build(name)
                torch.ops.load_library(str(library))
    except Exception as err:  # no compiler, no ninja, a header mismatch: the reference kernels still work
        log.warning("could not build hierremat's C++ kernels (%s: %s); packed masks use the pure-torch kernels",
                    type(err).__name__, str(err).strip().splitlines()[-1][:200] if str(err).strip() else "")
        return False
    log.debug("hierremat C++ kernels loaded from %s", _SOURCE)
    return True
