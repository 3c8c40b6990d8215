"""All-or-nothing application of stored values to variables.

Owns the rule that a restore changes nothing until everything has been checked:
:func:`check_matches` compares every dtype and shape first
(``CheckpointMismatchError`` listing every one), then :func:`apply_values` reads
and verifies every value before any variable changes:

- values for variables without memory yet are read (verified) into fresh arrays
  that the variables then adopt;
- values for variables that already hold memory are read into temporaries when
  they total at most :data:`TEMPORARY_BUDGET` bytes (a reader that stages values,
  ``SupportsStageIntoMany``, verifies packed values straight from one read of the
  packed blob and copies their bytes in phase two), else every one is verified
  first and then read straight into the variables' own buffers (reading the file
  twice, never holding a second copy of a large model).

With ``cast=True`` a stored value whose dtype differs from its variable's is
converted under the ``same_kind`` rules (float16/bfloat16 -> float32, int32 ->
int64, ...; never float -> int), value by value: each value is read, converted
and dropped before the next, so no second copy of the model is held. A cast is
never silent: one ``UserWarning`` per restore lists every key cast and both
dtypes (before any variable changes).

The optional fast paths a reader may offer are looked up in one place,
:func:`reader_abilities`.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import check_castable, check_range, dtype_name, narrows
from .._staging import fill_device, fillable, upload
from ..errors import CheckpointMismatchError, DTypeLockError
from ..storage import (
    ArrayInfo,
    Reader,
    SupportsReadIntoMany,
    SupportsRuns,
    SupportsShapeAndDtype,
    SupportsStageIntoMany,
    SupportsVerifyMany,
)
from ..variables import (
    Variable,
    device_buffer,
    device_value,
    give_restored,
    host_buffer,
    host_buffers,
    is_materialized,
    restore_value,
    shapes_and_dtypes,
)

__all__ = [
    "TEMPORARY_BUDGET",
    "ReaderAbilities",
    "apply_values",
    "check_cast_fits",
    "check_matches",
    "reader_abilities",
    "stored_infos",
    "warn_cast",
]

_first, _second = operator.itemgetter(0), operator.itemgetter(1)
_shape_of, _nbytes_of = operator.attrgetter("shape"), operator.attrgetter("nbytes")
_dtype_of = operator.attrgetter("dtype")
_NDARRAY = frozenset({np.ndarray})
#: a row whose variable's host buffer is still to be asked for (``host_buffer``)
_ASK = object()

#: Up to this many bytes of values going into existing variables are read into
#: temporaries (one pass over the file); above it, verify first, then read in place.
TEMPORARY_BUDGET = 64 * 2**20


@dataclass(frozen=True)
class ReaderAbilities:
    """The optional fast paths of one reader (``None`` where it offers none).

    ``shape_and_dtype(key)``: a value's shape and dtype without building an
    ``ArrayInfo``; ``read_into_many([(key, buf)], verify=)``: bulk reads into
    caller buffers; ``verify_many(keys)``: bulk checksum verification;
    ``stage_into_many([(key, buf)], checked=)``: read and verify now, copy into the
    buffers later (``checked``: the buffers are known to fit);
    ``shapes_and_dtypes(keys)``: ``shape_and_dtype`` of many keys in one pass.
    """

    shape_and_dtype: Callable[[str], tuple[tuple[int, ...], np.dtype]] | None
    read_into_many: Callable[..., Any] | None
    verify_many: Callable[[list[str]], Any] | None
    stage_into_many: Callable[..., Callable[[], None]] | None = None
    shapes_and_dtypes: (Callable[[list[str]], tuple[list[tuple[int, ...]], list[np.dtype]]]
                        | None) = None


def reader_abilities(reader: Any) -> ReaderAbilities:
    """What ``reader`` offers beyond the ``Reader`` interface (the one place it is asked):
    the optional protocols of :mod:`ckptvar.storage.base` it implements."""
    return ReaderAbilities(
        shape_and_dtype=(reader.shape_and_dtype
                         if isinstance(reader, SupportsShapeAndDtype) else None),
        read_into_many=(reader.read_into_many
                        if isinstance(reader, SupportsReadIntoMany) else None),
        verify_many=reader.verify_many if isinstance(reader, SupportsVerifyMany) else None,
        stage_into_many=(reader.stage_into_many
                         if isinstance(reader, SupportsStageIntoMany) else None),
        shapes_and_dtypes=(reader.shapes_and_dtypes
                           if isinstance(reader, SupportsShapeAndDtype) else None),
    )


class _LazyInfos(Mapping[str, ArrayInfo]):
    """``{key: ArrayInfo}`` of a native reader, each made when first asked for.

    A native reader answers from its decoded record, even after it is closed.
    """

    __slots__ = ("_keys", "_reader")

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._keys = reader.keys()

    def __getitem__(self, key: str) -> ArrayInfo:
        if key not in self._keys:
            raise KeyError(key)
        return self._reader.info(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def stored_infos(reader: Reader) -> Mapping[str, ArrayInfo]:
    """``{key: ArrayInfo}`` of everything ``reader`` holds; a native reader's are made
    only when asked for (a restore that matches by shape and dtype asks for none)."""
    if reader_abilities(reader).read_into_many is not None:  # native: from its record
        return _LazyInfos(reader)
    return {k: reader.info(k) for k in reader.keys()}  # noqa: SIM118 - a Reader is no dict


def _shape_matches(var_shape: tuple[int | None, ...] | None, found: tuple[int, ...]) -> bool:
    if var_shape is None:
        return True
    if len(var_shape) != len(found):
        return False
    return all(a is None or a == b for a, b in zip(var_shape, found, strict=True))


def _fmt_shape(shape: Any) -> str:
    return "unknown" if shape is None else str(tuple(shape))


def check_matches(  # noqa: C901 - one pass collects every mismatch kind, to report them all at once
    pairs: list[tuple[str, Variable]],
    infos: Mapping[str, ArrayInfo],
    path: Any,
    *,
    fast: Callable[[str], tuple[tuple[int, ...], np.dtype]] | None = None,
    cast: bool = False,
) -> dict[int, np.dtype]:
    """Raise ``CheckpointMismatchError`` listing every variable whose stored value differs.

    ``fast`` (a reader's ``shape_and_dtype``) answers the common case without an
    ``ArrayInfo``. With ``cast``, a stored dtype that converts to the variable's under
    ``same_kind`` is no mismatch: returns ``{id(variable): stored dtype}`` for those.
    """
    problems = []
    casts: dict[int, np.dtype] = {}
    could_cast = False
    for key, var in pairs:
        if fast is not None:
            shape, dtype = fast(key)
            if var.shape == shape and var.dtype == dtype:
                continue
        info = infos[key]
        if var.shape == info.shape and var.dtype == info.dtype:
            continue
        shape_ok = _shape_matches(var.shape, info.shape)
        dtype_ok = np.dtype(var.dtype) == info.dtype
        hint = ""
        if not dtype_ok:
            try:
                check_castable(info.dtype, var.dtype)
                castable = True
            except DTypeLockError:
                castable = False
            if cast and castable:
                dtype_ok = True
                casts[id(var)] = info.dtype
            elif cast:
                hint = " (not a same_kind cast)"
            elif castable and shape_ok:
                could_cast = True
        if not (dtype_ok and shape_ok):
            problems.append(
                f"{key!r} (variable {var.name!r}): expected shape {_fmt_shape(var.shape)} "
                f"dtype {dtype_name(var.dtype)}, found shape {_fmt_shape(info.shape)} "
                f"dtype {dtype_name(info.dtype)}{hint}"
            )
    if problems:
        more = " (restore(..., cast=True) converts same_kind dtypes)" if could_cast else ""
        raise CheckpointMismatchError(
            f"Cannot restore from {str(path)!r}: {len(problems)} stored value(s) do not match "
            f"their variables{more}; nothing was restored. " + "; ".join(problems) + "."
        )
    return casts


def _read_fresh(reader: Reader, keys: list[str], verify: bool) -> dict[str, np.ndarray]:
    """Each key's value in a fresh array (packed values: views into one verified read)."""
    unique = list(dict.fromkeys(keys))
    return dict(reader.read_many(unique, verify=verify))


def apply_values(  # noqa: C901, PLR0912, PLR0915 - the all-or-nothing protocol, step by step
    reader: Reader,
    pairs: list[tuple[str, Variable]],
    infos: Mapping[str, ArrayInfo],
    *,
    verify: bool = True,
    budget: int | None = None,
    cast: bool = False,
) -> None:
    """Validate, read and check all values, then assign them (all or nothing).

    ``pairs`` may name one variable under several keys or one key for several
    variables; each variable takes one value. ``cast`` converts same_kind dtypes
    (with a warning naming them).
    """
    able = reader_abilities(reader)
    keys = list(map(_first, pairs))
    variables = list(map(_second, pairs))
    shapes, dtypes = shapes_and_dtypes(variables)
    # two comparisons of lists when every stored shape and dtype is its variable's
    exact = able.shapes_and_dtypes is not None and (shapes, dtypes) == able.shapes_and_dtypes(
        keys)
    casts = {} if exact else check_matches(pairs, infos, reader.path,
                                           fast=able.shape_and_dtype, cast=cast)
    rows: Iterable[tuple[str, Variable, Any, Any]]
    # ``buf`` is the variable's own memory when it can take the value in place, else None
    fresh: list[tuple[str, Variable, np.ndarray | None]] = []
    in_place: list[tuple[str, Variable, np.ndarray]] = []
    in_place_bytes = 0
    bufs: list[Any] | None = None  # every variable's host buffer, all in place
    if len(set(map(id, variables))) != len(pairs):  # a variable under several keys
        by_var: dict[int, tuple[str, Variable]] = {}
        for key, var in pairs:
            by_var.setdefault(id(var), (key, var))
        rows = [(key, var, _ASK, None) for key, var in by_var.values()]
    elif exact:  # every host buffer at once, no call per variable
        handed: list[Any] = host_buffers(variables)
        bufs = handed
        try:  # the common case: every variable in host memory of its shape and dtype
            every = (list(map(_shape_of, bufs)) == shapes and list(map(_dtype_of, bufs)) == dtypes
                     and set(map(type, bufs)) <= _NDARRAY)
        except AttributeError:  # a variable without host memory (None)
            every = False
        if every:  # host_buffers: C-contiguous and writeable; stored shapes and dtypes equal
            in_place_bytes = sum(map(_nbytes_of, bufs))  # (in_place: made below if needed)
            rows = ()
        else:
            rows = zip(keys, variables, bufs, shapes, strict=True)
            bufs = None
    else:
        rows = [(key, var, _ASK, None) for key, var in pairs]
    # GPU variables of the stored shape: verified first, then copied straight into their
    # memory through the pinned buffer (no host copy of the values at all)
    on_device: list[tuple[str, Any]] = []
    runs = isinstance(reader, SupportsRuns)
    converted: list[tuple[str, Variable]] = []
    fast = able.shape_and_dtype
    add_in_place = in_place.append
    for key, var, asked, known in rows:
        if known is not None and asked is not None and asked.shape == known:
            add_in_place((key, var, asked))  # host_buffers: C-contiguous and writeable
            in_place_bytes += asked.nbytes
            continue
        if casts and id(var) in casts:
            converted.append((key, var))
            continue
        dbuf = device_value(var)  # a framework's GPU tensor the variable stands for
        buf = (None if dbuf is not None else host_buffer(var)) if asked is _ASK else asked
        if buf is None and dbuf is None and runs:
            dbuf = device_buffer(var)
        if runs and dbuf is not None and fillable(dbuf) and tuple(dbuf.shape) == (
                fast(key)[0] if fast else infos[key].shape):
            on_device.append((key, dbuf))
            continue
        # check_matches compared the shapes: a fully defined variable shape is the stored one
        if buf is not None and (buf.shape == var.shape or buf.shape == (
                fast(key)[0] if fast else infos[key].shape)):
            add_in_place((key, var, buf))  # host_buffer: C-contiguous and writeable
            in_place_bytes += buf.nbytes
        else:
            fresh.append((key, var, None))
    budget = TEMPORARY_BUDGET if budget is None else budget
    # Phase 1: everything that can fail.
    staged: Callable[[], None] | None = None
    if bufs is not None:  # every variable in place, each a plain ndarray that fits
        if verify and in_place_bytes <= budget and able.stage_into_many is not None and bufs:
            staged = able.stage_into_many(list(zip(keys, bufs, strict=True)), checked=True)
        else:
            in_place = list(zip(keys, variables, bufs, strict=True))
    if staged is None and verify and in_place_bytes <= budget:  # small: into temporaries too
        if able.stage_into_many is not None and in_place:  # read, verified, copied later
            staged = able.stage_into_many([(key, buf) for key, _, buf in in_place])
        else:
            fresh += in_place
        in_place = []
    got = _read_fresh(reader, [key for key, _, _ in fresh], verify) if fresh else {}
    values: list[tuple[Variable, np.ndarray, np.ndarray | None]] = []
    given: set[str] = set()
    for key, var, buf in fresh:
        value = got[key]
        if buf is None and key in given:  # one stored value for several variables
            value = value.copy()
        given.add(key)
        values.append((var, value, buf))
    cast_later = _cast_phase_one(reader, converted, values, verify)
    checked = [key for key, _, _ in in_place] + [key for key, _ in on_device]
    if verify and checked:
        if able.verify_many is not None:
            able.verify_many(checked)
        else:
            for key in checked:
                reader.verify(key)
    if cast_later and verify:  # one value at a time: nothing held but the value read
        for key in dict.fromkeys(key for key, _ in cast_later):
            reader.verify(key)
    if converted:
        warn_cast(reader.path, [(key, casts[id(var)], var) for key, var in converted])
    # Phase 2: change the variables.
    if staged is not None:
        staged()
    copyto = np.copyto
    for var, value, buf in values:
        if buf is not None:
            copyto(buf, value)  # the variable's own host memory, same shape and dtype
        else:
            give_value(var, value)
    if in_place:  # materialised, hence already initialized
        if able.read_into_many is not None:
            able.read_into_many([(key, buf) for key, _, buf in in_place], verify=False)
        else:
            for key, _, buf in in_place:
                reader.read(key, out=buf, verify=False)
    for key, dbuf in on_device:
        fill_device(reader, key, dbuf, verify=False)
    if cast_later:
        _cast_phase_two(reader, cast_later)


def _cast_phase_one(
    reader: Reader,
    converted: list[tuple[str, Variable]],
    values: list[tuple[Variable, np.ndarray, np.ndarray | None]],
    verify: bool,
) -> list[tuple[str, Variable]]:
    """Read and convert the values of variables without memory yet (appended to ``values``).

    Each converted array becomes its variable's memory; the stored-dtype array is
    dropped before the next is read. Returns the materialised variables, converted
    in phase two.
    """
    later = [(key, var) for key, var in converted if is_materialized(var)]
    now: dict[str, list[Variable]] = {}
    for key, var in converted:
        if not is_materialized(var):
            now.setdefault(key, []).append(var)
    for key, targets in now.items():
        stored = reader.read(key, verify=verify)
        for var in targets:
            _check_fits(reader, key, stored, var)
            values.append((var, stored.astype(var.dtype), None))
        del stored
    for key, var in later:  # a narrowing cast: the range is checked before any change
        if narrows(reader.info(key).dtype, var.dtype):
            _check_fits(reader, key, reader.read(key, verify=False), var)
    return later


def _check_fits(reader: Reader, key: str, stored: np.ndarray, var: Variable) -> None:
    check_cast_fits(reader, key, stored, var.dtype)


def check_cast_fits(reader: Reader, key: str, stored: np.ndarray, dtype: np.dtype) -> None:
    """Refuse a cast that would change a number's class (``_dtypes.check_range``): an
    integer wrapped (``int64 2**40 -> int32`` is 0), a finite float made inf
    (``float64 1e300 -> float32``)."""
    try:
        check_range(stored, dtype, f"{key!r}")
    except DTypeLockError as exc:
        raise CheckpointMismatchError(
            f"Cannot restore from {str(reader.path)!r} with cast=True: {exc} Nothing was restored."
        ) from None


def _cast_phase_two(reader: Reader, later: list[tuple[str, Variable]]) -> None:
    """Read each (verified) value again and convert it into its variable, one at a time."""
    wanted: dict[str, list[Variable]] = {}
    for key, var in later:
        wanted.setdefault(key, []).append(var)
    for key, targets in wanted.items():
        stored = reader.read(key, verify=False)
        for var in targets:
            buf = host_buffer(var)
            if buf is not None and buf.shape == stored.shape:
                np.copyto(buf, stored, casting="unsafe")  # same_kind was checked
            else:
                restore_value(var, stored.astype(var.dtype))
        del stored


def warn_cast(path: Any, casts: list[tuple[str, np.dtype, Variable]]) -> None:
    """One ``UserWarning`` naming every value a restore from ``path`` converted."""
    items = [f"{key!r} ({dtype_name(src)} -> {dtype_name(var.dtype)})" for key, src, var in casts]
    shown = ", ".join(items[:20]) + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")
    warnings.warn(
        f"Restore from {str(path)!r} cast {len(items)} stored value(s) to their variables' "
        f"dtypes (cast=True): {shown}.",
        UserWarning,
        stacklevel=4,
    )


#: Assign a restored value (materialised), or make it the initial value (pending).
def give_value(var: Variable, value: np.ndarray) -> None:
    """A restored host ``value`` for ``var``: into the GPU tensor it stands for (copied
    in place), else assigned or made its initial value (``give_restored``)."""
    tensor = device_value(var)
    if tensor is not None:
        upload(value, tensor)
    else:
        give_restored(var, value)
