"""A restricted unpickler for PyTorch checkpoints that never runs code from the file.

Owns: the explicit allow-list of globals a ``torch.save`` pickle may name, and
the placeholder objects they turn into. No torch module is imported: every
allowed name maps to a local stand-in (``torch._utils._rebuild_tensor_v2`` ->
a function returning a :class:`TensorRef`, ``torch.FloatStorage`` -> a
:class:`StorageType` carrying a NumPy dtype). Anything else named by the pickle
(``os.system``, ``builtins.eval``, ``subprocess.Popen``, ``torch.jit`` ...)
raises ``CorruptCheckpointError`` before it is looked up, so it can never be called.

>>> import io, pickle
>>> RestrictedUnpickler(io.BytesIO(pickle.dumps({"a": [1, 2.5]})), storages={}).load()
{'a': [1, 2.5]}
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from ..errors import CorruptCheckpointError

__all__ = [
    "DCP_GLOBALS",
    "PACKED_TORCH_DTYPES",
    "TORCH_DTYPES",
    "DcpRecord",
    "RestrictedUnpickler",
    "StorageRef",
    "StorageType",
    "TensorRef",
    "TorchDtype",
    "UnsupportedTensor",
    "expanded_size",
]


class _Sealed:
    """Objects a pickle can obtain but never modify (its BUILD opcode is refused)."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise CorruptCheckpointError(
            f"The pickle tries to set the state of {type(self).__name__}; refused."
        )


@dataclass(frozen=True)
class TorchDtype(_Sealed):
    """Stands for ``torch.<name>`` (a dtype object) in a pickle."""

    name: str
    np_dtype: np.dtype | None


@dataclass(frozen=True)
class StorageType(_Sealed):
    """Stands for ``torch.FloatStorage`` etc. (typed) or ``torch.UntypedStorage`` (bytes)."""

    name: str
    np_dtype: np.dtype


@dataclass(frozen=True)
class StorageRef(_Sealed):
    """One storage the pickle refers to: a key into the archive and its element count."""

    key: str
    dtype: np.dtype
    numel: int
    location: str


@dataclass(frozen=True)
class TensorRef(_Sealed):
    """A tensor as the pickle describes it: a strided view of a storage."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: np.dtype
    requires_grad: bool = False
    is_parameter: bool = False
    #: a packed torch dtype (``"float4_e2m1fn_x2"``): ``dtype`` is then its byte
    #: (uint8), each holding two values (:data:`PACKED_TORCH_DTYPES`)
    packed: str | None = None


@dataclass(frozen=True)
class UnsupportedTensor(_Sealed):
    """A tensor of a torch dtype NumPy and ml_dtypes cannot hold (``torch.quint8``,
    ``torch.bits8``): named, so the file's other values still read."""

    dtype: str

    def reason(self) -> str:
        return f"a torch.{self.dtype} tensor, a dtype ckptvar cannot hold"


class _Callable(_Sealed):
    """An allowed function, wrapped so the pickle cannot set attributes on it."""

    __slots__ = ("fn",)
    fn: Any

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"<allowed {self.fn.__name__}>"


_E = np.dtype
TORCH_DTYPES: dict[str, np.dtype | None] = {
    "float32": _E("float32"),
    "float": _E("float32"),
    "float64": _E("float64"),
    "double": _E("float64"),
    "float16": _E("float16"),
    "half": _E("float16"),
    "bfloat16": _E(ml_dtypes.bfloat16),
    "complex64": _E("complex64"),
    "cfloat": _E("complex64"),
    "complex128": _E("complex128"),
    "cdouble": _E("complex128"),
    "int8": _E("int8"),
    "uint8": _E("uint8"),
    "int16": _E("int16"),
    "short": _E("int16"),
    "int32": _E("int32"),
    "int": _E("int32"),
    "int64": _E("int64"),
    "long": _E("int64"),
    "uint16": _E("uint16"),
    "uint32": _E("uint32"),
    "uint64": _E("uint64"),
    "bool": _E("bool"),
    "float8_e4m3fn": _E(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": _E(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": _E(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": _E(ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": _E(ml_dtypes.float8_e8m0fnu),
    # two float16 halves, as ml_dtypes' complex32 (ml_dtypes 0.5 and later)
    "complex32": _E(ml_dtypes.complex32) if hasattr(ml_dtypes, "complex32") else None,
    "chalf": _E(ml_dtypes.complex32) if hasattr(ml_dtypes, "complex32") else None,
    # Named so a pickle mentioning them is understood; tensors of these dtypes are refused.
    "quint8": None,
    "qint8": None,
    "qint32": None,
    "quint4x2": None,
    "quint2x4": None,
    "float4_e2m1fn_x2": None,  # two values a byte: PACKED_TORCH_DTYPES
    "bits1x8": None,
    "bits2x4": None,
    "bits4x2": None,
    "bits8": None,
    "bits16": None,
    **{f"{sign}int{n}": None for sign in ("", "u") for n in range(1, 8)},
}

#: Torch dtypes of two values a byte, the last dimension halved: read as a byte tensor
#: (``TensorRef.packed``), each byte then unpacked into two values of this dtype, the
#: first from the low nibble (torch's order: its ONNX exporter unpacks 0x71 as 0.5, 6.0).
PACKED_TORCH_DTYPES: dict[str, np.dtype] = {"float4_e2m1fn_x2": _E(ml_dtypes.float4_e2m1fn)}

_STORAGE_TYPES: dict[str, np.dtype] = {
    "FloatStorage": _E("float32"),
    "DoubleStorage": _E("float64"),
    "HalfStorage": _E("float16"),
    "BFloat16Storage": _E(ml_dtypes.bfloat16),
    "ComplexFloatStorage": _E("complex64"),
    "ComplexDoubleStorage": _E("complex128"),
    "ByteStorage": _E("uint8"),
    "CharStorage": _E("int8"),
    "ShortStorage": _E("int16"),
    "IntStorage": _E("int32"),
    "LongStorage": _E("int64"),
    "BoolStorage": _E("bool"),
}


class _Marker(_Sealed):
    """A harmless stand-in for a tensor type (``torch.Tensor``, ``Parameter``)."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"<torch {self.name}>"


_TENSOR = _Marker("Tensor")
_PARAMETER = _Marker("Parameter")


def _check_int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CorruptCheckpointError(f"Tensor {what} {value!r} is not a tuple of ints.")
    return tuple(value)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRef | UnsupportedTensor:
    return _make_tensor(storage, storage_offset, size, stride, requires_grad, None)


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef | UnsupportedTensor:
    return _make_tensor(storage, storage_offset, size, stride, requires_grad, dtype)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef | UnsupportedTensor:
    return _make_tensor(storage, storage_offset, size, stride, False, None)


def _make_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, dtype: Any
) -> TensorRef | UnsupportedTensor:
    if not isinstance(storage, StorageRef):
        raise CorruptCheckpointError(f"A tensor refers to {type(storage).__name__}, not a storage.")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise CorruptCheckpointError(f"Tensor storage offset {offset!r} is not a non-negative int.")
    shape = _check_int_tuple(size, "size")
    strides = _check_int_tuple(stride, "stride")
    if len(shape) != len(strides):
        raise CorruptCheckpointError(f"Tensor size {shape} and stride {strides} differ in length.")
    if any(d < 0 for d in shape) or any(s < 0 for s in strides):
        raise CorruptCheckpointError(
            f"Tensor size {shape} / stride {strides} has negative entries."
        )
    if dtype is None:
        np_dtype = storage.dtype
    elif isinstance(dtype, TorchDtype):
        if dtype.name in PACKED_TORCH_DTYPES:
            return TensorRef(storage, offset, shape, strides, _E("uint8"),
                             bool(requires_grad), packed=dtype.name)
        if dtype.np_dtype is None:
            return UnsupportedTensor(dtype.name)
        np_dtype = dtype.np_dtype
    else:
        raise CorruptCheckpointError(f"Tensor dtype {dtype!r} is not a torch dtype.")
    return TensorRef(storage, offset, shape, strides, np_dtype, bool(requires_grad))


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any, *state: Any) -> Any:
    if isinstance(data, TensorRef):
        return dataclasses.replace(data, is_parameter=True, requires_grad=bool(requires_grad))
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func not in _REBUILDERS or new_type not in (_TENSOR, _PARAMETER):
        raise CorruptCheckpointError("Refused a tensor subclass rebuild in the pickle.")
    if not isinstance(args, tuple):
        raise CorruptCheckpointError("Tensor rebuild arguments are not a tuple.")
    result = func(*args)
    if new_type is _PARAMETER and isinstance(result, TensorRef):
        result = dataclasses.replace(result, is_parameter=True)
    return result


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    return _check_int_tuple(tuple(dims) if isinstance(dims, list) else dims, "size")


def _torch_device(*args: Any) -> str:
    return ":".join(str(a) for a in args if isinstance(a, str | int))


_REBUILD_V2 = _Callable(_rebuild_tensor_v2)
_REBUILD_V3 = _Callable(_rebuild_tensor_v3)
_REBUILD_V1 = _Callable(_rebuild_tensor)
_REBUILD_PARAM = _Callable(_rebuild_parameter)
_REBUILDERS = (_REBUILD_V2, _REBUILD_V3, _REBUILD_V1, _REBUILD_PARAM)

#: Every global a checkpoint pickle may name, and what it becomes here.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _REBUILD_V2,
    ("torch._utils", "_rebuild_tensor_v3"): _REBUILD_V3,
    ("torch._utils", "_rebuild_tensor"): _REBUILD_V1,
    ("torch._utils", "_rebuild_parameter"): _REBUILD_PARAM,
    ("torch._utils", "_rebuild_parameter_with_state"): _REBUILD_PARAM,
    ("torch._tensor", "_rebuild_from_type_v2"): _Callable(_rebuild_from_type_v2),
    ("torch", "Tensor"): _TENSOR,
    ("torch._tensor", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _PARAMETER,
    ("torch", "Size"): _Callable(_torch_size),
    ("torch", "device"): _Callable(_torch_device),
    ("torch.storage", "UntypedStorage"): StorageType("UntypedStorage", np.dtype("uint8")),
    ("torch", "UntypedStorage"): StorageType("UntypedStorage", np.dtype("uint8")),
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("__builtin__", "set"): set,
}
for _name, _dt in _STORAGE_TYPES.items():
    ALLOWED_GLOBALS[("torch", _name)] = StorageType(_name, _dt)
for _name, _torch_dt in TORCH_DTYPES.items():
    ALLOWED_GLOBALS[("torch", _name)] = TorchDtype(_name, _torch_dt)


class DcpRecord:
    """Stands for one of torch DCP's metadata classes: its pickled state kept as plain data.

    Made only by the unpickler (``NEWOBJ`` of an allowed DCP class, then ``BUILD`` once);
    ``kind`` names the DCP class, ``state`` is what the pickle set (a dict or a tuple).
    """

    __slots__ = ("state",)
    kind: ClassVar[str] = ""
    state: Any

    def __setstate__(self, state: Any) -> None:
        if getattr(self, "state", None) is not None:
            raise CorruptCheckpointError(f"The pickle sets the state of a DCP {self.kind} twice.")
        if not isinstance(state, dict | tuple):
            raise CorruptCheckpointError(
                f"The pickle gives a DCP {self.kind} a {type(state).__name__} state."
            )
        object.__setattr__(self, "state", state)

    def field(self, name: str, position: int, default: Any = ...) -> Any:
        """The field ``name`` of a dict state, or item ``position`` of a tuple state;
        ``default`` (when given) for a field the state leaves out."""
        state = getattr(self, "state", None)
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            merged = dict(state[0] or {}) if isinstance(state[0], dict) else {}
            state = {**merged, **state[1]}  # (dict state, slots state)
        if isinstance(state, dict):
            if name in state:
                return state[name]
        elif isinstance(state, tuple) and position < len(state):
            return state[position]
        if default is not ...:
            return default
        raise CorruptCheckpointError(f"A DCP {self.kind} has no field {name!r}.")


def _dcp_class(name: str) -> type[DcpRecord]:
    return type(name, (DcpRecord,), {"__slots__": (), "kind": name})


def _dcp_path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts if isinstance(p, str))


def _dcp_layout(name: Any) -> str:
    return str(name)


def _dcp_memory_format(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CorruptCheckpointError(f"A DCP memory format {value!r} is not an int.")
    return value


_DCP_MODULE = "torch.distributed.checkpoint.metadata"
#: The globals a DCP ``.metadata`` pickle may name besides the tensor basics (torch.Size,
#: dtypes): torch 2.x's metadata classes, and the small helpers their states use.
DCP_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MODULE, n): _dcp_class(n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    )
}
DCP_GLOBALS[(_DCP_MODULE, "_StorageInfo")] = _dcp_class("_StorageInfo")
DCP_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = DCP_GLOBALS[
    (_DCP_MODULE, "_StorageInfo")
]
_MEM_FORMAT = _Callable(_dcp_memory_format)
#: ``_MEM_FORMAT_ENCODING``'s members: an Enum member pickles by value on some Pythons
#: (``_MEM_FORMAT_ENCODING(0)``) and by name on others (``getattr(cls, "TORCH_...")``).
_MEM_FORMAT_MEMBERS = {
    "TORCH_CONTIGUOUS_FORMAT": 0,
    "TORCH_CHANNELS_LAST": 1,
    "TORCH_PRESERVE_FORMAT": 2,
}


def _dcp_getattr(obj: Any, name: Any) -> int:
    """``getattr`` as a DCP pickle may use it: a member of the memory-format enum, by name,
    and nothing else."""
    if obj is _MEM_FORMAT and isinstance(name, str) and name in _MEM_FORMAT_MEMBERS:
        return _MEM_FORMAT_MEMBERS[name]
    raise CorruptCheckpointError(
        f"A DCP pickle asks for the attribute {str(name)[:80]!r} of {obj!r}; only the members "
        f"of {_DCP_MODULE}._MEM_FORMAT_ENCODING are allowed (ckptvar never runs code from "
        "checkpoint files)."
    )


DCP_GLOBALS[(_DCP_MODULE, "_MEM_FORMAT_ENCODING")] = _MEM_FORMAT
DCP_GLOBALS[("builtins", "getattr")] = _Callable(_dcp_getattr)
DCP_GLOBALS[("torch.serialization", "_get_layout")] = _Callable(_dcp_layout)
DCP_GLOBALS[("pathlib", "PosixPath")] = _Callable(_dcp_path)
DCP_GLOBALS[("pathlib", "WindowsPath")] = _Callable(_dcp_path)
DCP_GLOBALS[("pathlib", "PurePosixPath")] = _Callable(_dcp_path)


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles only plain containers, tensors and storages (see ``ALLOWED_GLOBALS``).

    Built on the pure-Python unpickler on purpose: the C one allocates a
    ``BINBYTES``/``BINBYTES8``/``BYTEARRAY8`` object of the *declared* size before
    reading it, so a 100-byte pickle could ask for gigabytes. Here every read is
    bounded by the data actually present.

    ``storages`` is filled with a :class:`StorageRef` per persistent id; the
    caller decides where their bytes live (zip members or the legacy stream).
    """

    # Set by the pure-Python unpickler's load(); declared for the handlers below.
    read: Callable[[int], bytes]
    append: Callable[[Any], None]

    def __init__(
        self,
        file: io.BufferedIOBase | io.BytesIO,
        *,
        storages: dict[str, StorageRef],
        legacy: bool = False,
        source: str = "pickle",
        extra_globals: dict[tuple[str, str], Any] | None = None,
    ) -> None:
        """``extra_globals``: more allowed names for this pickle only (``DCP_GLOBALS``)."""
        super().__init__(file, encoding="utf-8")
        self._storages = storages
        self._legacy = legacy
        self._source = source
        self._extra = extra_globals or {}

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def _load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        data = self.read(size)  # bounded by what is there, unlike bytearray(size)
        if len(data) != size:
            raise CorruptCheckpointError(
                f"The pickle in {self._source} declares a {size}-byte bytearray; it is truncated."
            )
        self.append(bytearray(data))

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8

    def find_class(self, module: str, name: str) -> Any:
        try:
            if (module, name) in self._extra:
                return self._extra[(module, name)]
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise CorruptCheckpointError(
                f"Refused to load {self._source}: its pickle names the global "
                f"{module}.{name}, which is not a tensor, storage or plain container "
                "(ckptvar never runs code from checkpoint files)."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
            raise CorruptCheckpointError(
                f"Unknown persistent id {str(pid)[:80]!r} in {self._source} (only storages "
                "are allowed)."
            )
        if len(pid) not in (5, 6):
            raise CorruptCheckpointError(f"Malformed storage reference {pid!r} in {self._source}.")
        _, storage_type, key, location, numel = pid[:5]
        if not isinstance(storage_type, StorageType):
            raise CorruptCheckpointError(
                f"Storage {key!r} in {self._source} has type {storage_type!r}, not a storage type."
            )
        if not isinstance(key, str) or not key or len(key) > 64:
            raise CorruptCheckpointError(f"Storage key {key!r} in {self._source} is not valid.")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0 or numel >= 2**56:
            raise CorruptCheckpointError(
                f"Storage {key!r} in {self._source} declares {numel!r} elements."
            )
        if len(pid) == 6 and pid[5] is not None:
            raise CorruptCheckpointError(
                f"Storage {key!r} in {self._source} uses legacy storage views, not supported."
            )
        ref = self._storages.get(key)
        if ref is None:
            ref = StorageRef(key, storage_type.np_dtype, numel, str(location))
            self._storages[key] = ref
        elif ref.dtype != storage_type.np_dtype or ref.numel != numel:
            raise CorruptCheckpointError(
                f"Storage {key!r} in {self._source} is declared twice with different types/sizes."
            )
        return ref


def expanded_size(obj: Any, *, max_depth: int) -> int | None:
    """How many entries a walk of ``obj``'s dicts, lists and tuples visits, counting a
    container shared by reference once per use; None when nested deeper than ``max_depth``.

    Found with one visit per distinct container, so lists holding each other by
    reference (``[x, x]`` forty deep: 2**40 paths from a few hundred pickle bytes) are
    measured without being walked. A pickle without shared containers has fewer entries
    than bytes (each costs an opcode), so more entries than bytes means sharing.

    >>> x = [1, 2]
    >>> expanded_size([x, x], max_depth=8), expanded_size([[[1]]], max_depth=1)
    (7, None)
    """
    sizes: dict[int, int] = {}

    class _TooDeep(Exception):
        pass

    def size(value: Any, depth: int) -> int:
        if not isinstance(value, dict | list | tuple):
            return 1
        if depth > max_depth:
            raise _TooDeep
        known = sizes.get(id(value))
        if known is None:
            children = value.values() if isinstance(value, dict) else value
            known = sizes[id(value)] = 1 + sum(size(v, depth + 1) for v in children)
        return known

    try:
        return size(obj, 0)
    except _TooDeep:
        return None


def restricted_loads(data: bytes, *, source: str = "pickle") -> Any:
    """Unpickle ``data`` that must not refer to any storage (plain values only)."""
    return RestrictedUnpickler(io.BytesIO(data), storages={}, source=source).load()


def safe_load(
    file: io.BufferedIOBase | io.BytesIO,
    *,
    storages: dict[str, StorageRef],
    source: str,
    legacy: bool = False,
    extra_globals: dict[tuple[str, str], Any] | None = None,
) -> Any:
    """Run the restricted unpickler; every failure becomes ``CorruptCheckpointError``."""
    try:
        return RestrictedUnpickler(
            file, storages=storages, legacy=legacy, source=source, extra_globals=extra_globals
        ).load()
    except CorruptCheckpointError:
        raise
    except RecursionError:
        raise CorruptCheckpointError(f"The pickle in {source} nests too deeply.") from None
    except MemoryError:
        raise CorruptCheckpointError(f"The pickle in {source} asks for too much memory.") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CorruptCheckpointError(
            f"Cannot unpickle {source}: {type(exc).__name__}: {exc}"
        ) from None
