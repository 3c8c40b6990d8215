"""What ranks exchange to plan a save: each layout as one spec and one array of numbers.

A rank's layout goes over the wire as a *spec* (its keys, full shapes, dtypes and
the number of boxes of each key, ``-1`` for a replicated value), the spec's digest,
and every box's offset and shape as one array of ints (int32 when they fit, else
int64), in key order (``coords``).
Ranks of one job nearly always share the spec, so only rank 0 sends it
(:func:`layout_message`); a rank whose spec differs from rank 0's sends it in a
second, small gather (:func:`spec_senders` says who, the same on every rank).
:func:`plan_messages` plans from the messages: the common layout straight from the
stacked arrays (``_plan_fast.plan_columns``, no object per box), anything else from
the plain layouts the messages decode to (``_plan.plan_save_plain``: the same plan
and the same errors as :func:`~ckptvar.distributed.plan_save`). A layout whose
numbers are not plain ints goes as its plain form, unchanged.

>>> plain = [{"w": ((4, 2), "<f4", [((2 * r, 0), (2, 2))])} for r in range(2)]
>>> msgs = [layout_message(p, r) for r, p in enumerate(plain)]
>>> msgs[1][2] is None, msgs[1][3].tolist(), spec_senders(msgs)
(True, [2, 0, 2, 2], [])
>>> [(str(it.box), it.writer) for it in plan_messages(msgs).variables["w"].items]
[('[0:2, 0:2]', 0), ('[2:4, 0:2]', 1)]
"""

from __future__ import annotations

import hashlib
import marshal
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ShardLayoutError
from ._boxes import PlainLayout, SavePlan
from ._plan import plan_save_plain
from ._plan_fast import plan_columns

__all__ = ["Spec", "decode", "layout_message", "plan_messages", "spec_senders"]

#: keys, full shapes, dtypes, boxes per key (-1: replicated)
Spec = tuple[tuple[str, ...], tuple[tuple[int, ...], ...], tuple[str, ...], tuple[int, ...]]

#: ``("c", spec digest, spec or None, coords)`` or ``("p", plain layout)``
Message = tuple[Any, ...]


def _ints(values: Any, ndim: int) -> bool:
    return len(values) == ndim and all(type(v) is int for v in values)


def encode(plain: PlainLayout) -> tuple[Spec, np.ndarray] | None:
    """``(spec, coords)`` of a plain layout, or ``None`` when a number is not a plain int
    (or a box has the wrong number of axes): such a layout travels as it is."""
    keys, fulls, dtypes, counts = [], [], [], []
    flat: list[int] = []
    add = flat.extend
    for key, (full, dtype, boxes) in plain.items():
        ndim = len(full)
        if type(key) is not str or type(dtype) is not str or not _ints(full, ndim):
            return None
        keys.append(key)
        fulls.append(tuple(full))
        dtypes.append(dtype)
        if boxes is None:
            counts.append(-1)
            continue
        counts.append(len(boxes))
        for offset, shape in boxes:
            if not (_ints(offset, ndim) and _ints(shape, ndim)):
                return None
            add(offset)
            add(shape)
    try:
        coords = np.array(flat, np.int64)
    except OverflowError:
        return None
    if not coords.size or (coords.min() >= -(2**31) and coords.max() < 2**31):
        coords = coords.astype(np.int32)  # half the bytes on the wire
    return (tuple(keys), tuple(fulls), tuple(dtypes), tuple(counts)), coords


def _digest(spec: Spec) -> str:
    return hashlib.blake2b(marshal.dumps(spec, 2), digest_size=16).hexdigest()


def layout_message(plain: PlainLayout, rank: int) -> Message:
    """What ``rank`` sends in the layout gather of
    :func:`~ckptvar.distributed.gather_plan` for its plain layout (rank 0: with its spec)."""
    got = encode(plain)
    if got is None:
        return ("p", dict(plain))
    spec, coords = got
    return ("c", _digest(spec), spec if rank == 0 else None, coords)


def spec_senders(msgs: Sequence[Message]) -> list[int]:
    """The ranks whose spec differs from rank 0's (so was not sent): they send it next."""
    ref = msgs[0][1] if msgs[0][0] == "c" else None
    return [r for r, m in enumerate(msgs) if m[0] == "c" and m[2] is None and m[1] != ref]


def decode(spec: Spec, coords: np.ndarray, rank: int) -> dict[str, Any]:
    """The plain layout of ``spec`` and ``coords`` (rank ``rank``'s, named in errors)."""
    keys, fulls, dtypes, counts = spec
    values = coords.tolist()
    out: dict[str, Any] = {}
    pos = 0
    for key, full, dtype, count in zip(keys, fulls, dtypes, counts, strict=True):
        if count < 0:
            out[key] = (full, dtype, None)
            continue
        ndim = len(full)
        boxes = []
        for _ in range(count):
            boxes.append((tuple(values[pos:pos + ndim]), tuple(values[pos + ndim:pos + 2 * ndim])))
            pos += 2 * ndim
        out[key] = (full, dtype, boxes)
    if pos != len(values):
        raise ShardLayoutError(f"rank {rank}'s layout message holds {len(values)} numbers, "
                               f"its spec {pos}")
    return out


def plan_messages(msgs: Sequence[Message], specs: Sequence[Spec | None] = ()) -> SavePlan:
    """The save plan of every rank's layout message (``specs[r]``: rank ``r``'s spec from
    the second gather, for the ranks :func:`spec_senders` named)."""
    first = msgs[0]
    if first[0] == "c" and all(m[0] == "c" and m[1] == first[1] for m in msgs):
        plan = _plan_common(first[2], [m[3] for m in msgs])
        if plan is not None:
            return plan
    plains = []
    for r, m in enumerate(msgs):
        if m[0] == "p":
            plains.append(m[1])
            continue
        spec = m[2] if m[2] is not None else (
            first[2] if first[0] == "c" and m[1] == first[1]
            else specs[r] if r < len(specs) else None)
        if spec is None:
            raise ShardLayoutError(f"rank {r}'s layout came without its spec")
        plains.append(decode(spec, m[3], r))
    return plan_save_plain(plains)


def _plan_common(spec: Spec, coords: Sequence[np.ndarray]) -> SavePlan | None:
    """The plan when every rank has ``spec`` with one box per sharded key, straight from
    the stacked ``coords``; ``None`` when ``plan_save_plain`` must decide."""
    keys, fulls, dtypes, counts = spec
    if any(c not in (-1, 1) for c in counts):
        return None
    width = [2 * len(f) if c == 1 else 0 for f, c in zip(fulls, counts, strict=True)]
    total = sum(width)
    if any(c.shape != (total,) for c in coords):
        return None  # decode names the rank
    stacked = (np.stack(coords).astype(np.int64, copy=False) if coords
               else np.zeros((0, total), np.int64))
    starts = np.cumsum([0, *width[:-1]])
    groups: dict[int, list[int]] = {}
    for i, (full, count) in enumerate(zip(fulls, counts, strict=True)):
        if count == 1:
            groups.setdefault(len(full), []).append(i)
    arrays: dict[int, tuple[Any, Any, Any]] = {}
    for ndim, idx in groups.items():
        first = int(starts[idx[0]])
        if len(idx) * 2 * ndim == total and idx == list(range(idx[0], idx[0] + len(idx))):
            block = stacked[:, first:first + total]  # every column: a view
        else:
            cols = (starts[idx][:, None] + np.arange(2 * ndim)).reshape(-1)
            block = stacked[:, cols]
        per = block.reshape(len(stacked), len(idx), 2 * ndim).transpose(1, 0, 2)
        arrays[ndim] = (per[:, :, :ndim], per[:, :, ndim:],
                        np.array([fulls[i] for i in idx], np.int64).reshape(len(idx), ndim))
    return plan_columns(len(coords), keys, fulls, dtypes, [c < 0 for c in counts], groups,
                        arrays)
