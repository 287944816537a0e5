"""Runs of plain copies in a prepared program, executed as one C++ call each (the runtime's ``_C._CopyBatch``).

A plain copy moves a tile's bytes unchanged: a ``dma_copy`` (not indirect) or ``tensor_copy`` between equal
dtypes and element counts, between HBM and SBUF or within SBUF, not writing PSUM (a non-TensorE PSUM write also
closes accumulation groups); an ``nc_transpose`` whose source is a view (TensorE's opening of the PSUM
accumulation group it writes runs after the batch's copies, in order: no copy reads the flags); an fp32
identity ``activation`` without scale, bias or reduction. Its step (``isa.common.copy_step``) builds a view of
the run's HBM tensor and calls ``copy_``: 4-8 us of host time per copy, for tiles of a few hundred bytes. Consecutive plain copies run
in program order in one call instead, as strided byte copies, which is what ``copy_`` does for equal dtypes
(bits move unchanged; NaN payloads included); a source of another shape is read in the destination's where
that is a view, as the step's ``reshape`` reads it. Admitted only where that equivalence is plain: no
destination element written twice and, within SBUF, source and destination disjoint; HBM-to-HBM copies
(two slots may be one tensor) keep their step.

The C++ batch runner belongs to the extension above the simulator: the runtime hands it in
(``use_copy_batch``); a simulator used without it runs every copy's own step.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from torchneuron.sim.isa import Activation, DmaCopy, Instr, NcTranspose
from torchneuron.sim.isa.scalar_engine import _identity_out
from torchneuron.sim.isa.vector_engine import TensorCopy
from torchneuron.sim.memory import AP, writes_once


def _side(core, ap: AP, slots: Mapping[str, tuple[int, Any]]) -> tuple[Any, tuple[int, ...]] | None:
    """A copy side as ``_CopyBatch`` takes it, with its element shape: an on-chip view, or (slot, byte offset,
    byte strides) of an HBM slot (of any dtype: the batch moves the bytes ``ap`` names, as its view of the slot's
    bytes does); None where neither applies."""
    if ap.on_chip:
        view = ap.view(core)
        return view, tuple(view.shape)
    entry = slots.get(ap.memory)
    if entry is None:
        return None
    sizes, strides, offset = ap._geometry
    size = ap.dtype.itemsize
    if offset < 0 or any(st < 0 for st in strides):
        return None
    return (entry[0], offset * size, tuple(st * size for st in strides)), tuple(sizes)


def _plain(core, instr: Instr, slots: Mapping[str, tuple[int, Any]]) -> tuple | None:
    """``instr`` as one ``_CopyBatch`` copy (sizes, itemsize, dst side, src side) and what must follow the run
    (a TensorE transpose opening its PSUM accumulation group; else None), or None if it is not plain."""
    kind = type(instr)
    if kind is NcTranspose:
        return _transpose(core, instr)
    if kind is Activation:
        return _identity(core, instr)
    if kind is DmaCopy:
        if instr.src_index is not None or instr.dst_index is not None:
            return None
    elif kind is not TensorCopy:
        return None
    dst, src = instr.dst, instr.src
    if dst.dtype != src.dtype or dst.memory == "psum" or not (dst.on_chip or src.on_chip):
        return None
    d, s = _side(core, dst, slots), _side(core, src, slots)
    if d is not None and s is not None and d[1] != s[1]:
        # the step's store reads the source in dst's shape; where that is no view, dst in the source's shape pairs
        # the same elements (both in row-major order)
        reshaped = _reshaped(s, d[1], src.dtype)
        d, s = (d, reshaped) if reshaped is not None else (_reshaped(d, s[1], dst.dtype), s)
    if d is None or s is None:
        return None
    return _checked(dst, src, d[0], s[0], d[1])


def _reshaped(side: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> tuple | None:
    """A copy side (see ``_side``) read in ``shape`` (the same element count, row-major order: what ``reshape``
    gives), where that is a view; None where ``reshape`` would copy."""
    view, sizes = side
    try:
        if isinstance(view, torch.Tensor):
            return view.view(shape), shape
        slot, offset, strides = view
        size = dtype.itemsize
        elems = [st // size for st in strides]
        # the HBM pattern as a meta tensor (no data), viewed in the new shape: its strides and offset
        extent = offset // size + sum((n - 1) * st for n, st in zip(sizes, elems)) + 1
        v = torch.empty(extent, dtype=dtype, device="meta").as_strided(sizes, elems, offset // size).view(shape)
    except RuntimeError:
        return None
    return (slot, v.storage_offset() * size, tuple(st * size for st in v.stride())), shape


def _checked(dst: AP, src: AP, d: Any, s: Any, sizes: tuple[int, ...], after: Callable | None = None) -> tuple | None:
    """The copy of sides ``d`` and ``s`` (see ``_side``), or None where dst writes an element twice or the two
    patterns share memory."""
    if dst.overlaps(src):
        return None
    dst_strides = d.stride() if isinstance(d, torch.Tensor) else tuple(st // dst.dtype.itemsize for st in d[2])
    if not writes_once(sizes, dst_strides):
        return None
    return (list(sizes), dst.dtype.itemsize, d, s), after


def _transpose(core, instr: NcTranspose) -> tuple | None:
    """A transpose (the bits move unchanged), with TensorE's group opening after it: dst and its source as views
    in one shape (``NcTranspose.transposed_views``)."""
    views = instr.transposed_views(core)
    if views is None:
        return None
    dv, values = views
    return _checked(instr.dst, instr.data, dv, values, tuple(dv.shape), instr.group_opener(core))


def _identity(core, instr: Activation) -> tuple | None:
    """An fp32 identity activation without scale, bias or reduction (a bit copy: ``_identity_out``)."""
    if instr._fused is not _identity_out or instr._plan[1:] != (None, None):
        return None
    dv, xv = instr.dst.view(core), instr.data.view(core)
    if dv.shape != xv.shape:
        return None
    return _checked(instr.dst, instr.data, dv, xv, tuple(dv.shape))


_copy_batch: Callable[[list], Any] | None = None   # (runs) -> an object whose .run(h) executes them


def use_copy_batch(factory: Callable[[list], Any] | None) -> None:
    """Execute runs of plain copies through ``factory(run).run`` (the runtime passes ``_C._CopyBatch``); None:
    each copy its own step."""
    global _copy_batch
    _copy_batch = factory


def batch_copies(core, entries: Sequence[tuple], slots: Mapping[str, tuple[int, Any]]) -> tuple:
    """``entries`` (instr, step, closes) with each run of consecutive plain copies (that have a step) replaced by
    one entry whose step runs them all (its instr: the run's first)."""
    if _copy_batch is None:
        return tuple(entries)
    out: list[tuple] = []
    run: list[tuple] = []
    after: list[Callable] = []
    first: Instr | None = None

    def flush() -> None:
        if run:
            out.append((first, _run_step(_copy_batch(run).run, tuple(after)), None))
            run.clear()
            after.clear()

    for instr, step, closes in entries:
        plain = _plain(core, instr, slots) if step is not None and closes is None else None
        if plain is None:
            flush()
            out.append((instr, step, closes))
            continue
        if not run:
            first = instr
        run.append(plain[0])
        if plain[1] is not None:
            after.append(plain[1])
    flush()
    return tuple(out)


def _run_step(run: Callable, after: tuple[Callable, ...]) -> Callable:
    """The step of a batch: its copies, then the group openings of its TensorE transposes (the PSUM flags are
    read by no copy, so opening them after the copies leaves every flag as the steps one by one would)."""
    if not after:
        return run

    def step(h):
        run(h)
        for open_group in after:
            open_group()
    return step
