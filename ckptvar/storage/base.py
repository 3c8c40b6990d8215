"""The one small interface every checkpoint format sits behind.

Storage knows arrays, keys and plain attribute dicts; it never imports the
variable core. A :class:`Backend` makes :class:`Reader` and :class:`Writer`
objects for one format:

- A ``Writer`` collects ``(key, array, attrs)`` with :meth:`Writer.add` (no copy
  is taken: the caller keeps each array unchanged until :meth:`Writer.commit`),
  plus one msgpack-able metadata dict, and writes everything at ``commit()``:
  to a temporary sibling, fsynced, then renamed onto the final path (atomic).
- A ``Reader`` is a read-only ``Mapping[str, LazyArray]``: ``reader[key]`` costs
  no I/O, ``reader[key][0:10]`` reads only that slice, ``reader.read(key, out=buf)``
  reads a whole value into a caller's buffer and verifies its checksum.

Keys are ``/``-separated object-graph paths (``model/dense/kernel``); how a key
maps to a place inside a container is each backend's business (docs/FORMAT.md).

Optional abilities: a reader may offer more than the ``Reader`` ABC asks for, and
callers test for each with ``isinstance`` against a small runtime-checkable
protocol (never by probing for a method's name). A new backend offers one by
defining the method, and says so by listing the protocol among its bases:

- :class:`SupportsShapeAndDtype`: ``shape_and_dtype(key)`` without making an
  ``ArrayInfo`` (what a restore checks per value);
- :class:`SupportsReadIntoMany`: ``read_into_many([(key, out), ...])`` fills
  many caller buffers in few system calls;
- :class:`SupportsStageIntoMany`: ``stage_into_many([(key, out), ...])`` reads and
  verifies many values before any buffer changes (an all-or-nothing restore of
  small values in one pass);
- :class:`SupportsRuns`: ``read_run_into(key, start, out)`` fills a caller's buffer
  with a run of a value's elements and ``verify_run(key, start, count)`` checks one
  (a part of a stored shard, when resharding);
- :class:`SupportsVerifyMany`: ``verify_many(keys)`` checks many values at once;
- :class:`SupportsVerifyAll`: ``verify_all()`` lists every damaged value.

ckptvar's own readers (HDF5, Zarr) offer all six.

>>> import os, tempfile
>>> from ckptvar.storage import backend_for
>>> scratch = tempfile.TemporaryDirectory()
>>> path = os.path.join(scratch.name, "w.h5")
>>> with backend_for(path, mode="w").open_writer(path) as writer:
...     writer.add("w", np.zeros(3, np.float32))
>>> with backend_for(path).open_reader(path) as reader:
...     isinstance(reader, SupportsReadIntoMany), reader.shape_and_dtype("w")
(True, ((3,), dtype('float32')))
>>> scratch.cleanup()
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from ..errors import CkptError, CorruptCheckpointError, UnsupportedFormatError

__all__ = [
    "ArrayInfo",
    "Backend",
    "LazyArray",
    "Reader",
    "SupportsDeltas",
    "SupportsReadIntoMany",
    "SupportsRuns",
    "SupportsShapeAndDtype",
    "SupportsShared",
    "SupportsStageIntoMany",
    "SupportsStoredBoxes",
    "SupportsVerifyAll",
    "SupportsVerifyMany",
    "Writer",
]


@dataclass(frozen=True)
class ArrayInfo:
    """What a checkpoint says about one stored value, known without reading it.

    ``attrs`` holds what the writer was given (``name``, ``trainable``, ...);
    ``checksum`` is the stored checksum of the whole value, ``None`` for formats that
    carry none; ``piecewise`` is true when the value is instead checked by the checksums
    of its pieces (the boxes of a multi-process checkpoint). :attr:`checked` says whether
    reading it verifies anything.
    """

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    checksum: int | None = None
    piecewise: bool = False

    @property
    def checked(self) -> bool:
        """Whether a read of this value is verified against stored checksums."""
        return self.checksum is not None or self.piecewise

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


#: Why a reader or its lazy values cannot be pickled, and what to do instead.
_NO_PICKLE = ("it holds open files of this process; send the path and call cv.open(path) "
              "in the other process")


class LazyArray(abc.ABC):
    """A stored value that is read only when sliced (``lazy[0:10]``) or read whole."""

    info: ArrayInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype:
        return self.info.dtype

    @property
    def ndim(self) -> int:
        return len(self.info.shape)

    @property
    def size(self) -> int:
        return self.info.size

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    def __len__(self) -> int:
        if not self.info.shape:
            raise TypeError("len() of a 0-d array")
        return self.info.shape[0]

    @abc.abstractmethod
    def __getitem__(self, index: Any) -> np.ndarray:
        """Read only the elements ``index`` selects (basic slicing at least)."""

    @abc.abstractmethod
    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        """Read the whole value (into ``out`` when given), verifying its checksum."""

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The value read (NumPy's array protocol). A read always makes a new array, so
        ``copy=False`` (NumPy 2: never copy) raises ``ValueError``."""
        if copy is False:
            raise ValueError(
                f"np.asarray(..., copy=False) of lazy value {self.info.key!r}: a read "
                "always makes a new array; pass copy=None or call .read()."
            )
        arr = self.read()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"<LazyArray {self.info.key!r} shape={self.info.shape} dtype={self.info.dtype}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"cannot pickle a lazy value ({self.info.key!r}) of a checkpoint "
                        f"reader: {_NO_PICKLE}")


class Reader(Mapping[str, LazyArray], contextlib.AbstractContextManager["Reader"], abc.ABC):
    """A read-only view of one checkpoint. Use as a context manager or call ``close()``.

    ``skipped`` is ``{key: reason}`` for the user values present in the file that the
    reader cannot return as arrays (string tensors, compound HDF5 datasets); empty
    for a format that stores only arrays. A reader that skips values sets its own.
    ``changed`` is ``{key: how}`` for the values it returns in another dtype or shape
    than the file stores them (a packed torch ``float4_e2m1fn_x2`` tensor unpacked);
    empty for most formats.
    """

    path: Path
    format: str
    skipped: Mapping[str, str] = MappingProxyType({})
    changed: Mapping[str, str] = MappingProxyType({})

    @abc.abstractmethod
    def keys(self) -> Any:  # KeysView[str], in file order
        ...

    @abc.abstractmethod
    def info(self, key: str) -> ArrayInfo:
        """Metadata of ``key``; raises ``MissingKeyError`` for an unknown key."""

    @abc.abstractmethod
    def __getitem__(self, key: str) -> LazyArray: ...

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def metadata(self) -> dict[str, Any]:
        """The metadata dict given to :meth:`Writer.set_metadata` (empty if none)."""
        return {}

    def __reduce__(self) -> Any:
        raise TypeError(f"cannot pickle a checkpoint reader of {str(self.path)!r}: "
                        f"{_NO_PICKLE}")

    def read(self, key: str, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        """Read one whole value, into ``out`` when given (same shape and dtype)."""
        return self[key].read(out=out, verify=verify)

    def read_many(
        self, keys: Iterable[str], *, verify: bool = True
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Read several values into fresh arrays; backends may pipeline I/O and checksums."""
        for key in keys:
            yield key, self.read(key, verify=verify)

    def verify(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` if ``key``'s bytes do not match its checksum."""
        self.read(key, verify=True)

    def close(self) -> None:  # optional hook: nothing to release by default
        """Release file handles."""

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def verify_each(reader: Reader, keys: Iterable[str]) -> list[tuple[str, str]]:
    """Check each key with ``reader.verify``; ``[(key, reason), ...]`` for each damaged one.

    A read that could not ask (:func:`unreached`: the store did not answer) is raised: it
    says nothing of the bytes."""
    bad: list[tuple[str, str]] = []
    for key in keys:
        try:
            reader.verify(key)
        except CorruptCheckpointError as exc:
            bad.append((key, str(exc)))
        except OSError as exc:
            if unreached(exc):
                raise
            bad.append((key, f"cannot be read: {exc}"))
    return bad


def unreached(exc: BaseException) -> bool:
    """Whether a failed read says nothing of the stored bytes: ckptvar's ``OSError`` of a
    store that did not answer in time or at all (``StorageError``, a timeout), unlike
    damage, a missing file or the file system's own error.

    >>> from ckptvar.locations import StorageError
    >>> unreached(StorageError("GET s3://b/k failed after retries")), unreached(OSError(5, "EIO"))
    (True, False)
    """
    return (isinstance(exc, CkptError) and isinstance(exc, OSError)
            and not isinstance(exc, FileNotFoundError))


@runtime_checkable
class SupportsShapeAndDtype(Protocol):
    """A reader that tells a stored value's shape and dtype without an ``ArrayInfo``."""

    def shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        """``(shape, dtype)`` of ``key``; raises ``MissingKeyError`` for an unknown key."""
        ...

    def shapes_and_dtypes(self, keys: list[str]) -> tuple[list[tuple[int, ...]], list[np.dtype]]:
        """``([shape, ...], [dtype, ...])`` of the keys in one pass (a restore of many
        values); raises ``MissingKeyError`` for the first unknown key."""
        ...


@runtime_checkable
class SupportsShared(Protocol):
    """A reader of a checkpoint whose values may share their bytes with other checkpoints
    (incremental steps, docs/checkpoints.md)."""

    def shared(self) -> dict[str, list[str]]:
        """For each value whose bytes are shared: the other checkpoints (file names beside
        this one) that hold or share them; the first is the holder when there is one."""
        ...


@runtime_checkable
class SupportsDeltas(Protocol):
    """A reader of a checkpoint whose values may be stored as row deltas (format 1.5)."""

    def deltas(self) -> dict[str, dict[str, Any]]:
        """For each value stored as a row delta: ``{"base": the checkpoint that wrote its
        whole copy, "patches": how many row patches it has, "rows": their rows, repeats
        counted}``."""
        ...


@runtime_checkable
class SupportsStoredBoxes(Protocol):
    """A reader of a checkpoint whose values are stored as boxes of a logical array (the
    multi-process layout: shards of partitioned variables, DTensors, sharded jax.Arrays)."""

    def stored_boxes(self, key: str) -> list[Any]:
        """The boxes stored for ``key``, each with ``offset`` and ``shape`` (index order)."""
        ...


@runtime_checkable
class SupportsReadIntoMany(Protocol):
    """A reader that fills many caller buffers at once."""

    def read_into_many(self, pairs: list[tuple[str, np.ndarray]], *, verify: bool = True) -> None:
        """Read each ``(key, out)`` value into ``out`` (same shape and dtype, C-contiguous,
        writeable). With ``verify`` a damaged value raises ``CorruptCheckpointError``, but
        other buffers may already hold new bytes: verify first when that matters."""
        ...


@runtime_checkable
class SupportsStageIntoMany(Protocol):
    """A reader that reads and verifies many values before changing any caller buffer."""

    def stage_into_many(
        self, pairs: list[tuple[str, np.ndarray]], *, checked: bool = False
    ) -> Callable[[], None]:
        """Read and verify each ``(key, out)`` value now (``CorruptCheckpointError`` for a
        damaged one, no ``out`` changed), into temporaries the size of the values; the
        function returned copies them into the ``out`` buffers (same shape and dtype,
        C-contiguous, writeable). ``checked``: the caller has made sure of that for
        every ``out`` (a plain ``np.ndarray``), so it is not checked again."""
        ...


@runtime_checkable
class SupportsRuns(Protocol):
    """A reader that reads or checks a run of a value's elements (C order) alone."""

    def read_run_into(
        self, key: str, start: int, out: np.ndarray, *, verify: bool = True
    ) -> None:
        """Fill ``out`` (flat, C-contiguous, the stored dtype) with elements ``[start,
        start + out.size)`` of ``key`` in C order, verified by what the format can check
        of them (ckptvar's own: the blocks holding them)."""
        ...

    def verify_run(self, key: str, start: int, count: int) -> None:
        """Raise ``CorruptCheckpointError`` unless elements ``[start, start + count)`` of
        ``key`` verify (ckptvar's own: the blocks holding them; without block checksums,
        the whole value)."""
        ...


@runtime_checkable
class SupportsVerifyMany(Protocol):
    """A reader that checks many values at once."""

    def verify_many(self, keys: Iterable[str]) -> None:
        """Raise ``CorruptCheckpointError`` for the first damaged value among ``keys``."""
        ...


@runtime_checkable
class SupportsVerifyAll(Protocol):
    """A reader that lists every damaged value rather than stopping at the first."""

    def verify_all(self) -> list[tuple[str, str]]:
        """``[(key, reason), ...]`` for each damaged value; empty when all verify."""
        ...


class Writer(contextlib.AbstractContextManager["Writer"], abc.ABC):
    """Collects values and metadata, then writes them atomically at :meth:`commit`."""

    path: Path

    @abc.abstractmethod
    def add(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        """Register ``array`` under ``key``; the array must stay unchanged until commit.

        ``array`` may also be a :class:`~ckptvar.storage.Chunked` value (a GPU tensor
        staged through the pinned buffer): every writer takes it a piece at a time (a
        writer that needs it whole, for a small packed value, uses ``storage.as_host``)."""

    @abc.abstractmethod
    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """A msgpack-able dict stored with the checkpoint (object graph, counters, ...)."""

    @abc.abstractmethod
    def commit(self) -> Path:
        """Write everything durably and move it onto the final path; returns that path."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop everything written so far; the final path is untouched."""

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Backend(abc.ABC):
    """One checkpoint format: how to recognise it, read it and (maybe) write it."""

    name: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]]
    #: what :meth:`open_writer` builds as ``writer(path, **options)``; ``None``: read-only
    writer: ClassVar[Callable[..., Writer] | None] = None
    #: whether this format can be written (set from :attr:`writer`)
    can_write: ClassVar[bool] = False
    #: True when a file or directory with this format's suffix that :meth:`sniff` does not
    #: claim may be another format's (a Keras ``.h5``): ``backend_for`` then hands it to
    #: the first other backend that claims it.
    hands_over_unrecognised: ClassVar[bool] = False
    #: When a path's suffix says nothing, backends sniff it in ascending order of this
    #: (ties: registration order): ckptvar's own formats first, the generic HDF5
    #: reader last, so a specific layout is never taken for a generic one.
    sniff_priority: ClassVar[int] = 50

    @classmethod
    @abc.abstractmethod
    def sniff(cls, path: Path) -> bool:
        """True when ``path`` looks like this format by its content (cheap)."""

    @classmethod
    @abc.abstractmethod
    def open_reader(cls, path: Path) -> Reader: ...

    def __init_subclass__(
        cls,
        *,
        name: str | None = None,
        suffixes: tuple[str, ...] | None = None,
        writer: Callable[..., Writer] | None = None,
        hands_over_unrecognised: bool | None = None,
        sniff_priority: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Declare a format in its class statement: ``class B(Backend, name="npz", ...)``."""
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
        if suffixes is not None:
            cls.suffixes = suffixes
        if writer is not None:
            cls.writer = writer
        if hands_over_unrecognised is not None:
            cls.hands_over_unrecognised = hands_over_unrecognised
        if sniff_priority is not None:
            cls.sniff_priority = sniff_priority
        cls.can_write = cls.writer is not None

    @classmethod
    def open_writer(cls, path: Path, **options: Any) -> Writer:
        """A writer for a new checkpoint at ``path`` (``options``: the writer's own)."""
        if cls.writer is None:
            raise UnsupportedFormatError(f"The {cls.name} format is read-only in ckptvar.")
        return cls.writer(Path(path), **options)
