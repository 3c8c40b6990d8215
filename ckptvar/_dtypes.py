"""Dtype rules shared by the core and the storage layer.

Owns: TensorFlow-style dtype inference for Python values, the one home of the dtype
kind rules (:func:`kind_of`, :func:`is_floating`, :func:`can_cast_same_kind`, and the
``same_kind`` write checks built on them, for arrays and for weak Python values),
bfloat16 and the other ``ml_dtypes`` (through ``ml_dtypes``), and the explicit list of
dtypes a checkpoint may hold, with their names as written in files.

>>> import numpy as np
>>> infer_dtype(1.5), infer_dtype(3), infer_dtype(True)
(dtype('float32'), dtype('int32'), dtype('bool'))
>>> dtype_to_str(as_dtype("bfloat16")), str_to_dtype("bfloat16") == as_dtype("bfloat16")
('bfloat16', True)
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import DTypeLockError

__all__ = [
    "BFLOAT16",
    "ML_DTYPES",
    "SUPPORTED_DTYPES",
    "as_dtype",
    "can_cast_same_kind",
    "check_castable",
    "check_int_range",
    "check_range",
    "check_value_castable",
    "dtype_name",
    "dtype_to_str",
    "infer_dtype",
    "is_floating",
    "kind_of",
    "narrows",
    "str_to_dtype",
]

BFLOAT16: np.dtype = np.dtype(ml_dtypes.bfloat16)

#: The dtypes a variable or a checkpoint may hold, by the name written in files.
#: Everything else (object, structured, strings, datetimes, ...) is refused.
SUPPORTED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
SUPPORTED_DTYPES["bfloat16"] = BFLOAT16
#: Every other type ml_dtypes defines (TensorFlow, JAX, PyTorch and MX checkpoints carry
#: them); stored as their bits, never inferred. Sub-byte types take one byte per element.
ML_DTYPES = (
    "float8_e4m3fn", "float8_e5m2", "int4", "uint4",
    "float8_e4m3", "float8_e3m4", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn",
    "int1", "int2", "uint1", "uint2", "complex32", "bcomplex32",
)
for _name in ML_DTYPES:
    if hasattr(ml_dtypes, _name):
        SUPPORTED_DTYPES[_name] = np.dtype(getattr(ml_dtypes, _name))

_BY_DTYPE: dict[np.dtype, str] = {dt: name for name, dt in SUPPORTED_DTYPES.items()}


def as_dtype(dtype: Any) -> np.dtype:
    """Normalise ``dtype`` (a name, a NumPy dtype or type) to a supported native-endian dtype.

    >>> as_dtype("float32"), as_dtype(np.int64)
    (dtype('float32'), dtype('int64'))
    """
    if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[dtype]
    try:
        dt: np.dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"Not a dtype: {dtype!r}.") from exc
    if dt.byteorder not in ("=", "|"):
        dt = dt.newbyteorder("=")
    if dt not in _BY_DTYPE:
        raise TypeError(
            f"Unsupported dtype {dt!s}; supported: {', '.join(sorted(SUPPORTED_DTYPES))}."
        )
    return dt


def dtype_to_str(dtype: np.dtype) -> str:
    """The name of a supported dtype as written in checkpoint files."""
    try:
        return _BY_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"Unsupported dtype {dtype!s}.") from None


def str_to_dtype(name: str) -> np.dtype:
    """Inverse of :func:`dtype_to_str`; only names on the explicit list are accepted."""
    try:
        return SUPPORTED_DTYPES[name]
    except (KeyError, TypeError):
        raise TypeError(f"Unsupported dtype name {name!r}.") from None


def infer_dtype(value: Any) -> np.dtype:
    """The dtype TensorFlow would give ``value``.

    Python ``float`` -> float32, ``int`` -> int32 (int64 when one does not fit int32),
    ``bool`` -> bool, ``complex`` -> complex128; NumPy arrays and scalars keep theirs; nested lists follow their
    elements (any float makes float32).
    """
    if isinstance(value, np.ndarray | np.generic):
        return as_dtype(value.dtype)
    if hasattr(value, "dtype") and not isinstance(value, list | tuple):
        return as_dtype(value.dtype)
    kinds: set[type] = set()
    _collect_kinds(value, kinds)
    if not kinds:
        return np.dtype("float32")
    # the widest kind present decides, as in TensorFlow
    for kind, name in ((complex, "complex128"), (float, "float32"), (int, "int32")):
        if kind in kinds:
            return np.dtype("int64" if kind is int and _BigInt in kinds else name)
    return np.dtype("bool")


class _BigInt:
    """Marks a Python int outside int32: TensorFlow then infers int64 (``2**40``)."""


def _collect_kinds(value: Any, kinds: set[type]) -> None:
    if isinstance(value, bool | np.bool_):
        kinds.add(bool)
    elif isinstance(value, int | np.integer):
        kinds.add(int)
        if isinstance(value, int) and not -(2**31) <= value < 2**31:
            kinds.add(_BigInt)
    elif isinstance(value, float | np.floating):
        kinds.add(float)
    elif isinstance(value, complex | np.complexfloating):
        kinds.add(complex)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect_kinds(item, kinds)
    elif isinstance(value, np.ndarray):
        kinds.add({"b": bool, "i": int, "u": int, "f": float, "c": complex}.get(value.dtype.kind, float))
    else:
        raise TypeError(f"Cannot convert {type(value).__name__} {value!r} to an array.")


# bool < integers < floats < complex; signed -> unsigned is never same_kind.
_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def kind_of(dtype: Any) -> str | None:
    """The NumPy kind of ``dtype`` (``b``, ``i``, ``u``, ``f``, ``c``), ml_dtypes included.

    bfloat16 and the float8 types are ``"f"``, int4 ``"i"``, uint4 ``"u"``; anything that is
    not a number (strings, objects, structured) is ``None``.

    >>> kind_of("bfloat16"), kind_of("int4"), kind_of("float32"), kind_of("U3")
    ('f', 'i', 'f', None)
    """
    dt = np.dtype(dtype)
    if dt.isbuiltin != 1:  # ml_dtypes types report kinds V, f or W; structured dtypes V
        name = _BY_DTYPE.get(dt)
        if name is None:
            return None
        if name.startswith("int"):
            return "i"
        if name.startswith("uint"):
            return "u"
        return "c" if "complex" in name else "f"
    return dt.kind if dt.kind in "biufc" else None


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating type: float16/32/64, bfloat16, the float8 types.

    >>> is_floating("bfloat16"), is_floating("float8_e4m3fn"), is_floating("int4")
    (True, True, False)
    >>> is_floating("complex64"), is_floating(np.float16)
    (False, True)
    """
    return kind_of(dtype) == "f"


def can_cast_same_kind(src: Any, dst: Any) -> bool:
    """NumPy's ``same_kind`` rule, extended to the ml_dtypes types by their kind.

    >>> can_cast_same_kind("uint8", "int32"), can_cast_same_kind("int32", "uint8")
    (True, False)
    >>> can_cast_same_kind("int32", "bfloat16"), can_cast_same_kind("bfloat16", "int32")
    (True, False)
    """
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst:
        return True
    s_kind, d_kind = kind_of(src), kind_of(dst)
    if s_kind is None or d_kind is None:
        return False
    if src.isbuiltin == 1 and dst.isbuiltin == 1:
        return bool(np.can_cast(src, dst, casting="same_kind"))
    # an ml_dtypes type on one side: compare kinds the way NumPy's same_kind does
    return _KIND_RANK[s_kind] <= _KIND_RANK[d_kind] and not (s_kind == "i" and d_kind == "u")


def check_castable(src: np.dtype, dst: np.dtype, *, what: str = "value") -> None:
    """Raise :class:`DTypeLockError` unless ``src`` converts to ``dst`` under ``same_kind``.

    bfloat16 counts as a float kind both ways (int -> bfloat16 is fine,
    bfloat16 -> int is not).

    >>> check_castable(np.dtype("int32"), np.dtype("float32"))
    >>> check_castable(np.dtype("uint8"), np.dtype("int32"))
    >>> check_castable(np.dtype("float32"), np.dtype("int32"), what="'v'")
    Traceback (most recent call last):
    ...
    ckptvar.errors.DTypeLockError: Cannot convert 'v' of dtype float32 to dtype int32 (only same_kind conversions are allowed).
    """
    if not can_cast_same_kind(src, dst):
        raise DTypeLockError(
            f"Cannot convert {what} of dtype {dtype_name(src)} to dtype {dtype_name(dst)} "
            "(only same_kind conversions are allowed)."
        )


def check_value_castable(value: Any, dst: np.dtype, *, what: str = "value") -> None:
    """Raise :class:`DTypeLockError` unless ``value`` converts to ``dst`` under ``same_kind``.

    Arrays follow :func:`can_cast_same_kind` (``uint8 -> int32`` is fine, ``int32 ->
    uint8`` is not). Python scalars and lists are "weak", as in NumPy 2 and TensorFlow:
    only their kind counts, so ``[1, 2]`` fits a ``uint8`` variable.

    >>> check_value_castable([1, 2], np.dtype("uint8"))
    >>> check_value_castable(np.array([1, 2]), np.dtype("uint8"), what="'v'")
    Traceback (most recent call last):
    ...
    ckptvar.errors.DTypeLockError: Cannot convert 'v' of dtype int64 to dtype uint8 (only same_kind conversions are allowed).
    """
    try:
        src = infer_dtype(value)
    except TypeError as exc:
        raise DTypeLockError(f"Cannot convert {what}: {exc}") from None
    weak = not hasattr(value, "dtype")
    std = src.kind in _KIND_RANK and dst.kind in _KIND_RANK
    if weak and std and _KIND_RANK[src.kind] <= _KIND_RANK[dst.kind]:
        # (src is int64 only for a Python int beyond int32: one may be beyond int64 too)
        if src.kind in "iu" and dst.kind in "iu" and (dst.itemsize < 8 or dst.kind == "u"
                                                      or src.itemsize == 8):
            if type(value) is int:  # a step counter's += 1: no array made
                info = _IINFO.get(dst) or _IINFO.setdefault(dst, np.iinfo(dst))
                if info.min <= value <= info.max:
                    return
            # beyond int32, exactly (NumPy would make [2**63, 0] float64)
            check_int_range(np.asarray(value, dtype=object if src.itemsize == 8 else None),
                            dst, what)
        return
    check_castable(src, dst, what=what)
    if src.kind in "iu" and dst.kind in "iu" and not np.can_cast(src, dst, casting="safe"):
        check_int_range(value, dst, what)


_IINFO: dict[np.dtype, Any] = {}


def check_int_range(value: Any, dst: np.dtype, what: str) -> None:
    """Raise :class:`DTypeLockError` when an integer ``value`` holds a number ``dst`` cannot:
    ``same_kind`` allows ``int64 -> int8``, but NumPy's cast would wrap ``1000`` to ``-24``.

    >>> check_int_range(np.array([1000, 0]), np.dtype("int8"), "'v'")
    Traceback (most recent call last):
    ...
    ckptvar.errors.DTypeLockError: Cannot convert 'v' to dtype int8: 1000 is outside its range [-128, 127] (the cast would wrap it).
    """
    if not value.size:
        return
    if value.dtype == object:  # Python ints beyond 64 bits; anything else NumPy itself refuses
        items = value.ravel().tolist()
        if not all(type(i) is int for i in items):
            return
        lo, hi = min(items), max(items)
    elif value.dtype.kind in "iu":
        lo, hi = int(value.min()), int(value.max())
    else:
        return
    info = np.iinfo(dst)
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise DTypeLockError(
            f"Cannot convert {what} to dtype {dtype_name(dst)}: {bad} is outside its range "
            f"[{info.min}, {info.max}] (the cast would wrap it)."
        )


def narrows(stored: Any, dtype: Any) -> bool:
    """Whether a cast from ``stored`` to ``dtype`` can change a number's class: an integer
    wrapped (int64 -> int32), or a finite float turned inf or NaN (float64 -> float32).

    >>> narrows(np.int64, np.int32), narrows(np.float64, np.float32), narrows(np.float16, np.float32)
    (True, True, False)
    """
    stored, dtype = np.dtype(stored), np.dtype(dtype)
    if stored.kind in "iu" and dtype.kind in "iu":
        return not np.can_cast(stored, dtype, "safe")
    return is_floating(stored) and is_floating(dtype) and not _holds_range(stored, dtype)


def check_range(value: np.ndarray, dst: np.dtype, what: str) -> None:
    """Raise :class:`DTypeLockError` when casting ``value`` to ``dst`` would change a
    number's class: an integer wrapped (:func:`check_int_range`), or a finite float
    turned into inf (NaN in a type without inf), or an inf into NaN.

    >>> check_range(np.array([1.0, 1e300]), np.dtype("float32"), "'v'")
    Traceback (most recent call last):
    ...
    ckptvar.errors.DTypeLockError: Cannot convert 'v' to dtype float32: 1e+300 is outside its finite range [-3.4028235e+38, 3.4028235e+38] (the cast would make it inf).
    """
    dst = np.dtype(dst)
    if value.dtype.kind in "iu":
        check_int_range(value, dst, what)
        return
    if not value.size or not is_floating(value.dtype) or not is_floating(dst):
        return
    if _holds_range(value.dtype, dst):
        return
    largest = _largest(dst)
    with np.errstate(over="ignore", invalid="ignore"):
        over = np.abs(value) > largest  # only these can change class: none, nearly always
        if not over.any():
            return
        src = value[over]
        out = src.astype(dst)
        changed = (np.isfinite(src) & ~np.isfinite(out)) | (np.isinf(src) & np.isnan(out))
    if changed.any():
        bad = src[changed][0]
        into = "NaN" if np.isnan(out[changed][0]) else "inf"
        shown = repr(float(bad)) if np.isfinite(bad) else str(bad)
        raise DTypeLockError(
            f"Cannot convert {what} to dtype {dtype_name(dst)}: {shown} is outside its finite "
            f"range [{-largest:.8g}, {largest:.8g}] (the cast would make it {into})."
        )


def _largest(dtype: np.dtype) -> float:
    """The largest finite value of a NumPy or ml_dtypes floating type."""
    finfo: Any = ml_dtypes.finfo  # untyped
    return float(finfo(dtype).max)


def _holds_range(source: np.dtype, target: np.dtype) -> bool:
    """Whether every finite ``source`` value is finite in ``target``, and infinities stay."""
    return _largest(target) >= _largest(source) and (_holds_inf(target) or not _holds_inf(source))


def _holds_inf(dtype: np.dtype) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isinf(np.array(np.inf).astype(dtype)))


def dtype_name(dt: np.dtype) -> str:
    """A readable name for any dtype (the file name for supported ones)."""
    return _BY_DTYPE.get(np.dtype(dt), str(dt))
