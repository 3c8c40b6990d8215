"""Partitioned variables in one process (TensorFlow 1): one logical variable, several parts.

Owns :class:`PartitionedVariable` (the parts, in order, and the full value they make),
:class:`PartitionInfo` (what an initializer is told about the part it fills), the three
TF partitioners with ``tf.compat.v1`` semantics (:func:`fixed_size_partitioner`,
:func:`min_max_variable_partitioner`, :func:`variable_axis_size_partitioner`) and
:func:`make_partitioned`, the slicing rule ``get_variable(..., partitioner=)`` uses: one
axis is cut into ``n`` parts of ``dim // n`` rows, the first ``dim % n`` parts one more.

>>> fixed_size_partitioner(4)(shape=(10, 3), dtype=np.dtype("float32"))
[4, 1]
>>> part_sizes(10, 4)
[3, 3, 2, 2]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._dtypes import as_dtype, dtype_name, infer_dtype
from ..errors import ShapeLockError, VariableScopeError
from ..initializers import check_produces
from ._lifecycle import convert_value
from ._shapes import defined_dims, fully_defined, normalize_shape
from ._slices import SaveSliceInfo
from ._variable import Variable, restore_value

__all__ = [
    "PartitionInfo",
    "PartitionedVariable",
    "defined_shape",
    "fixed_size_partitioner",
    "make_partitioned",
    "min_max_variable_partitioner",
    "part_sizes",
    "variable_axis_size_partitioner",
]

Partitioner = Callable[..., Sequence[int]]


class PartitionInfo:
    """Passed as ``partition_info=`` to initializers that accept it (as TensorFlow does)."""

    def __init__(self, full_shape: Sequence[int], var_offset: Sequence[int]) -> None:
        self.full_shape = tuple(full_shape)
        self.var_offset = tuple(var_offset)

    def single_offset(self, shape: Sequence[int]) -> int:
        """The offset along the one partitioned axis (0 when none is)."""
        axis = self.single_slice_dim(shape)
        return 0 if axis is None else self.var_offset[axis]

    def single_slice_dim(self, shape: Sequence[int]) -> int | None:
        """The axis along which a part of ``shape`` is cut from the full shape."""
        for axis, (part, full) in enumerate(zip(shape, self.full_shape, strict=True)):
            if part != full:
                return axis
        return None

    def __repr__(self) -> str:
        return f"PartitionInfo(full_shape={self.full_shape}, var_offset={self.var_offset})"


class PartitionedVariable:
    """A logical variable stored as parts cut along one axis (``get_variable`` makes them).

    ``len(pv)`` parts; iterating yields the part :class:`~ckptvar.Variable` objects
    (``name/part_0``, ...), each with a ``save_slice_info``; ``np.asarray(pv)`` is the full
    value; ``pv.assign(full_value)`` writes every part.
    """

    def __init__(self, name: str, parts: Sequence[Variable], full_shape: Sequence[int],
                 dtype: np.dtype, partitions: Sequence[int]) -> None:
        self._name = name
        self._parts = tuple(parts)
        self._shape = tuple(int(d) for d in full_shape)
        self._dtype = np.dtype(dtype)
        self._partitions = tuple(int(p) for p in partitions)
        self._axis = next((i for i, p in enumerate(self._partitions) if p > 1), 0)

    @property
    def name(self) -> str:
        """The logical variable's name (``scope/name``); the parts are ``name/part_i``."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        """The full shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def partitions(self) -> tuple[int, ...]:
        """How many parts along each axis (what the partitioner returned)."""
        return self._partitions

    def get_shape(self) -> tuple[int, ...]:
        return self._shape

    def _get_variable_list(self) -> list[Variable]:  # the TensorFlow spelling
        return list(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def __iter__(self) -> Iterator[Variable]:
        return iter(self._parts)

    def numpy(self) -> np.ndarray:
        """The full value (a new host array)."""
        return np.concatenate([p.numpy() for p in self._parts], axis=self._axis)

    read_value = numpy

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The full value (NumPy's array protocol). Its parts are always concatenated into
        a new array, so ``copy=False`` (NumPy 2: never copy) raises ``ValueError``."""
        if copy is False:
            raise ValueError(
                f"np.asarray(..., copy=False) of partitioned variable {self._name!r}: its "
                "parts are always concatenated into a new array; pass copy=None or call "
                ".numpy()."
            )
        full = self.numpy()
        return full if dtype is None else full.astype(dtype, copy=False)

    def assign(self, value: Any) -> PartitionedVariable:
        """Write the full ``value`` into the parts; checks dtype and shape before any write,
        and when a part's constraint refuses its piece, the parts written before it get
        their old values back: a failed assign changes nothing."""
        what = f"a value assigned to partitioned variable {self._name!r}"
        arr = convert_value(self._parts[0], value, what)
        if tuple(arr.shape) != self._shape:
            raise ShapeLockError(
                f"Cannot assign to partitioned variable {self._name!r}: shape "
                f"{tuple(arr.shape)} does not match its full shape {self._shape}."
            )
        pieces = []
        for part in self._parts:
            info = part.save_slice_info
            assert info is not None
            index = tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape,
                                                           strict=True))
            pieces.append(arr[index])
        # A part's constraint may refuse its piece after earlier parts took theirs: keep
        # what those held, to put back (without a constraint nothing fails past the checks).
        before = ([part.numpy() for part in self._parts]
                  if any(part.constraint is not None for part in self._parts) else None)
        done = 0
        try:
            for part, piece in zip(self._parts, pieces, strict=True):
                part.assign(piece)
                done += 1
        except BaseException:
            if before is not None:
                for part, old in zip(self._parts[:done], before, strict=False):
                    restore_value(part, old)
            raise
        return self

    def __repr__(self) -> str:
        return (f"<cv.PartitionedVariable {self._name!r} shape={self._shape} "
                f"dtype={dtype_name(self._dtype)} parts={len(self._parts)}>")


# --- the TensorFlow partitioners ------------------------------------------------------------


def _element_size(dtype: Any, bytes_per_string_element: int) -> int:
    dt = np.dtype(dtype)
    return bytes_per_string_element if dt.kind in "SUO" else dt.itemsize


def fixed_size_partitioner(num_shards: int, axis: int = 0) -> Partitioner:
    """``num_shards`` parts along ``axis`` (fewer when the axis is shorter)."""

    def partitioner(shape: Sequence[int], **unused: Any) -> list[int]:
        if not -len(shape) <= axis < len(shape):
            raise VariableScopeError(
                f"Can not partition variable along axis {axis} when shape is only "
                f"{tuple(shape)}."
            )
        partitions = [1] * len(shape)
        partitions[axis] = min(num_shards, int(shape[axis]))
        return partitions

    return partitioner


def min_max_variable_partitioner(max_partitions: int = 1, axis: int = 0,
                                 min_slice_size: int = 256 << 10,
                                 bytes_per_string_element: int = 16) -> Partitioner:
    """As many parts along ``axis`` as keep each at least ``min_slice_size`` bytes, at most
    ``max_partitions`` (and never more than the axis is long)."""

    def partitioner(shape: Sequence[int], dtype: Any, **unused: Any) -> list[int]:
        if axis >= len(shape):
            raise VariableScopeError(
                f"Can not partition variable along axis {axis} when shape is only "
                f"{tuple(shape)}."
            )
        total = math.prod(int(d) for d in shape) * _element_size(dtype, bytes_per_string_element)
        partitions = [1] * len(shape)
        partitions[axis] = max(1, min(int(shape[axis]), max_partitions,
                                      math.ceil(total / min_slice_size)))
        return partitions

    return partitioner


def variable_axis_size_partitioner(max_shard_bytes: int, axis: int = 0,
                                   bytes_per_string_element: int = 16,
                                   max_shards: int | None = None) -> Partitioner:
    """Parts along ``axis`` of at most ``max_shard_bytes`` each when one row fits (at most
    ``max_shards`` parts, which then may be larger)."""
    if max_shard_bytes < 1 or bytes_per_string_element < 1:
        raise VariableScopeError(
            "Both max_shard_bytes and bytes_per_string_element must be positive."
        )
    if max_shards is not None and max_shards < 1:
        raise VariableScopeError("max_shards must be positive.")

    def partitioner(shape: Sequence[int], dtype: Any, **unused: Any) -> list[int]:
        dims = [int(d) for d in shape]
        if not dims or dims[axis] == 0:
            raise VariableScopeError(
                f"Cannot partition a variable of shape {tuple(dims)} along axis {axis}."
            )
        per_row = math.prod(dims) / dims[axis] * _element_size(dtype, bytes_per_string_element)
        rows_per_shard = max(1, math.floor(max_shard_bytes / per_row)) if per_row else dims[axis]
        shards = math.ceil(dims[axis] / rows_per_shard)
        if max_shards:
            shards = min(max_shards, shards)
        partitions = [1] * len(dims)
        partitions[axis] = shards
        return partitions

    return partitioner


# --- creating the parts ----------------------------------------------------------------------


def defined_shape(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints; :class:`VariableScopeError` naming ``what`` (say
    ``"a new variable ('w')"``) when it is not fully defined."""
    req = normalize_shape(shape)
    if not fully_defined(req):
        raise VariableScopeError(
            f"Shape of {what} must be fully defined, but instead was {shape!r}."
        )
    return defined_dims(req)


def part_sizes(dim: int, n: int) -> list[int]:
    """``dim`` rows cut into ``n`` parts, the first ``dim % n`` one row longer (as TF1)."""
    base, extra = divmod(dim, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _check_partitions(name: str, partitions: Any, shape: tuple[int, ...]) -> tuple[int, int]:
    try:  # operator.index: 2.5 parts is refused, never truncated to 2
        parts = [operator.index(p) for p in partitions]
    except TypeError:
        raise VariableScopeError(
            f"The partitioner of {name!r} returned {partitions!r}, not a list of ints."
        ) from None
    if len(parts) != len(shape):
        raise VariableScopeError(
            f"The partitioner of {name!r} returned {parts} for shape {shape}: one entry per "
            "dimension is needed."
        )
    if any(p < 1 for p in parts):
        raise VariableScopeError(
            f"The partitioner of {name!r} returned zero parts for an axis: {parts} for shape "
            f"{shape}."
        )
    cut = [i for i, p in enumerate(parts) if p > 1]
    if len(cut) > 1:
        raise VariableScopeError(
            f"Can only slice a variable along one dimension: the partitioner of {name!r} "
            f"returned {parts}."
        )
    axis = cut[0] if cut else 0
    if parts[axis] > shape[axis]:
        raise VariableScopeError(
            f"The partitioner of {name!r} asked for {parts[axis]} parts along axis {axis}, "
            f"which has only {shape[axis]} rows."
        )
    return axis, parts[axis]


def make_partitioned(
    full: str, shape: Any, dtype: Any, initializer: Any, from_value: bool,
    partitioner: Partitioner, *, make_part: Callable[..., Variable],
    default_initializer: Callable[[np.dtype, str], Any], bind: Callable[..., Any],
) -> PartitionedVariable:
    """Cut ``full`` as ``partitioner`` says and make each part with ``make_part``.

    ``make_part(name, initial, dtype, shape, save_slice_info)`` creates one part;
    ``bind(initializer, shape, dtype, partition_info)`` binds an initializer to a part.
    """
    value: np.ndarray | None = None
    if from_value:
        raw = initializer.numpy() if isinstance(initializer, Variable) else initializer
        dt = as_dtype(dtype) if dtype is not None else infer_dtype(raw)
        value = np.asarray(raw)
        full_shape = tuple(int(d) for d in value.shape)
        if shape is not None and normalize_shape(shape) != full_shape:
            raise VariableScopeError(
                f"Variable {full!r}: shape={shape!r} does not match the initial value's shape "
                f"{full_shape}."
            )
    else:
        dt = as_dtype(dtype if dtype is not None else "float32")
        full_shape = defined_shape(shape, f"a new partitioned variable ({full!r})")
    if not full_shape:
        raise VariableScopeError(
            f"A partitioned variable must have rank at least 1; {full!r} is a scalar."
        )
    partitions = partitioner(shape=full_shape, dtype=dt)
    axis, n = _check_partitions(full, partitions, full_shape)
    init = None if from_value else (
        initializer if initializer is not None else default_initializer(dt, full))
    check_produces(init, dt, f"Cannot make partitioned variable {full!r}")
    parts: list[Variable] = []
    start = 0
    for i, size in enumerate(part_sizes(full_shape[axis], n)):
        offset = tuple(start if a == axis else 0 for a in range(len(full_shape)))
        part_shape = tuple(size if a == axis else d for a, d in enumerate(full_shape))
        info = SaveSliceInfo(full, full_shape, offset, part_shape)
        if value is not None:
            initial: Any = value[tuple(slice(o, o + s) for o, s in zip(offset, part_shape,
                                                                        strict=True))]
        else:
            initial = bind(init, part_shape, dt, PartitionInfo(full_shape, offset))
        parts.append(make_part(f"{full}/part_{i}", initial, dt, part_shape, info))
        start += size
    return PartitionedVariable(full, parts, full_shape, dt, [int(p) for p in partitions])
