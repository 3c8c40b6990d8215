"""``ckpt convert``: any readable checkpoint to .h5, .zarr, .safetensors, HF shards or .npz.

The scripts in ``scripts/convert_*.py`` run this same conversion.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import mmap
import os
import re
import shlex
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import ckptvar as cv

from . import _blocks
from ._blocks import is_floating, value_blocks
from ._common import (
    EXIT_OK,
    UsageError,
    add_selection,
    is_url,
    latest_or_path,
    open_checkpoint,
    select,
    selected,
    storage_options,
)
from ._lazy import lazy_module, load_now
from ._output import escape, one_line
from ._progress import Progress, human_size

if TYPE_CHECKING:
    import ml_dtypes
    import numpy as np
else:  # loaded on first use: `ckpt --help` imports no NumPy
    np = lazy_module("numpy")
    ml_dtypes = lazy_module("ml_dtypes")

#: An uncast value larger than this is read in runs of this size (each verified by the
#: block checksums it covers), so the progress bar moves within it.
RUN_BYTES = 64 << 20
#: ``convert`` shows its progress bar by itself (on a terminal) from this many bytes on.
PROGRESS_MIN_BYTES = 16 << 20
#: Outputs up to this size (or twice the largest value, if more) are built in memory;
#: a larger one is spooled through a memory-mapped scratch file beside DST.
DEFAULT_WINDOW = 512 << 20

EPILOG = """\
Writes DST in the format its suffix names (.h5, .zarr, .safetensors, .npz) or
--format, with SRC's per-value name and trainable flag and its metadata (so a
converted ckptvar checkpoint still restores with Checkpoint.restore). DST's
missing parent folders are created. DST appears whole or not at all.

Each source byte is read once (verified as it is read), cast and handed to the
writer once. An output up to --window (default: 512M, or twice the largest
value) is built in memory; a larger one streams through a scratch file beside
DST (removed at the end; it needs the output's size of free space), so memory
stays bounded however large the checkpoint. Only floating values are
cast by --dtype (integers, booleans and complex values keep their dtype).

--filter and --exclude take globs and are repeatable: a key is converted when
it matches any --filter (or none is given) and no --exclude. A selection that
matches nothing is an error. Values SRC holds that are not numbers (string or
compound HDF5 datasets, TF string tensors) make the conversion fail, naming
them, unless --skip-unreadable (then it says how many it left out). A dtype the
output format cannot store (or a packed sub-byte value whose count cannot end
on a byte) fails before anything is written, naming every such key. --rename FROM=TO applies re.sub(FROM, TO, key) to every key; give it
several times to apply several substitutions in order (the first '=' splits
FROM from TO). A progress bar (in bytes, moving within large values) appears on
stderr for large conversions when stderr is a terminal, or always with
--progress.

examples:
  ckpt convert pytorch_model.bin model.h5
  ckpt convert runs/ckpt-3.h5 out/model.safetensors --dtype bfloat16
  ckpt convert tf_ckpt/ckpt-1 model.zarr --rename '^model/=' --rename 'kernel$=weight'
  ckpt convert tf_ckpt/ckpt-1 m.safetensors --filter 'model/*' --filter 'optimizer/*'
  ckpt convert data.h5 weights.npz --skip-unreadable --exclude 'debug/*'
  ckpt convert dcp_checkpoint/ hf_model/ --format hf-safetensors --max-shard-size 5GB
"""


HELP = "convert a checkpoint to .h5, .zarr, .safetensors, a Hugging Face folder or .npz"
DESCRIPTION = (
    "Convert any readable checkpoint to .h5, .zarr, .safetensors, a Hugging Face sharded "
    "folder (--format hf-safetensors) or .npz."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt convert``."""
    p.add_argument("src", metavar="SRC", help="the checkpoint to read")
    p.add_argument("dst", metavar="DST", help="the file or .zarr directory to write")
    p.add_argument(
        "--dtype",
        type=_parse_dtype,
        metavar="DTYPE",
        help=f"cast floating values to DTYPE ({', '.join(_FLOAT_TARGETS)})",
    )
    p.add_argument(
        "--rename",
        type=_parse_rename,
        action="append",
        default=[],
        metavar="FROM=TO",
        help="regex substitution on keys (repeatable, applied in order)",
    )
    p.add_argument(
        "--format",
        metavar="FMT",
        choices=_WritableFormats(),
        help="output format (%(choices)s); default: DST's suffix",
    )
    p.add_argument(
        "--pack-threshold",
        type=_parse_size,
        metavar="SIZE",
        help=".h5/.zarr output: pack values under SIZE bytes into one blob (0: every value "
        "its own dataset, named by its key, for plain h5py/zarr; default: packing only in "
        "checkpoints of more than 2,048 values)",
    )
    add_selection(p)
    p.add_argument(
        "--no-metadata",
        action="store_true",
        help="do not copy SRC's metadata (object graph, counters, user metadata); a "
        "safetensors 'format' entry (pt, tf, flax, mlx) is kept, as Hugging Face loaders "
        "require it (safetensors output gets format=pt when SRC names none, and says so)",
    )
    p.add_argument(
        "--metadata",
        type=_parse_metadata,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="add a string entry to DST's metadata (repeatable; in a safetensors header: "
        "__metadata__, beside format=pt)",
    )
    p.add_argument(
        "--max-shard-size",
        type=_parse_shard_size,
        metavar="SIZE",
        help="with --format hf-safetensors: the largest shard (like transformers: 5GB = "
        "5*10^9 bytes, 500MB, 20KiB; default 5GB); one file when everything fits",
    )
    p.add_argument(
        "--skip-unreadable",
        action="store_true",
        help="convert the rest when SRC holds values that cannot be read as numbers "
        "(string or compound datasets); they are named and counted",
    )
    p.add_argument(
        "--window",
        type=_parse_size,
        metavar="SIZE",
        help="most bytes of output built in memory (default: 512M or twice the largest "
        "value); a larger output streams through a scratch file beside DST",
    )
    p.add_argument("-f", "--force", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: for large conversions on a terminal)",
    )


#: The writable formats the registry holds once loaded, named here so that the help
#: lists them without loading it (h5py, zarr and every format module: most of a second);
#: a test checks them against ``cv.storage.writable_formats()``.
WRITABLE_FORMATS = ("h5", "zarr", "safetensors", "hf-safetensors", "npz")


class _WritableFormats:
    """The ``--format`` choices: the registry's writable formats, asked only when a
    ``--format`` is given (so a format registered later is taken). Listed (the help, an
    invalid choice) as :data:`WRITABLE_FORMATS` until then, the registry's once asked."""

    def __init__(self) -> None:
        self._asked: list[str] | None = None

    def _names(self) -> list[str]:
        if self._asked is None:
            load_now()  # before the registry's own imports: a Ctrl-C raises as it should
            self._asked = list(cv.storage.writable_formats())
        return self._asked

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._asked if self._asked is not None else WRITABLE_FORMATS)


_FLOAT_TARGETS = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


def _parse_dtype(name: str) -> np.dtype:
    if name not in _FLOAT_TARGETS:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a floating dtype; choose one of {', '.join(_FLOAT_TARGETS)}"
        )
    try:
        return np.dtype(name)
    except TypeError:
        found: np.dtype = np.dtype(getattr(ml_dtypes, name))
        return found


def _parse_metadata(spec: str) -> tuple[str, str]:
    key, sep, value = spec.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {spec!r}")
    return key, value


def _parse_shard_size(text: str) -> int:
    try:
        return int(cv.formats.parse_shard_size(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_rename(spec: str) -> tuple[re.Pattern[str], str]:
    pattern, sep, repl = spec.partition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(f"wants FROM=TO (a regex and a replacement), got {spec!r}")
    try:
        return re.compile(pattern), repl
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{pattern!r} is not a valid regex: {exc}") from None


_KEPT_ATTRS = ("name", "trainable")


class _Converted(Mapping[str, "np.ndarray"]):
    """The output values of a conversion, each read (and cast) only when the writer asks.

    Each source byte is read once, verified as it is read: a reader of ckptvar's own
    format reads a value in runs, each checked by the block checksums it covers; another
    format's value is read in blocks through its lazy array (then its stored checksum
    checked, if it has one). A value is cast run by run into its output array: in memory
    when the whole output fits the window, else a region of the scratch file beside DST
    (:class:`_Spool`), written there by ``pwrite`` and handed to the writer as a view of
    the file's mapping.
    """

    def __init__(
        self,
        reader: Any,
        plan: dict[str, str],
        dtype: np.dtype | None,
        progress: Progress,
        spool: _Spool | None,
        *,
        finishing: str = "",
    ) -> None:
        self._reader = reader
        self._plan = plan  # output key -> source key
        self._dtype = dtype
        self._progress = progress
        self._spool = spool
        self._given = 0
        self._finishing = finishing  # said once every value is read: what comes next
        #: per output key, the elements --dtype turned into inf or NaN (see ``_cast_run``)
        self.lost: dict[str, int] = {}

    def _target(self, dtype: np.dtype) -> np.dtype:
        return self._dtype if self._dtype is not None and is_floating(dtype) else dtype

    def __getitem__(self, key: str) -> np.ndarray:
        src = self._plan[key]
        info = self._reader.info(src)
        stored = np.dtype(info.dtype)
        dtype = self._target(stored)
        shape = tuple(info.shape)
        self._given += 1
        try:
            if self._spool is not None and math.prod(shape):
                return self._spooled(key, src, info, dtype)
            if dtype == stored and isinstance(self._reader, cv.storage.SupportsReadIntoMany):
                out = np.empty(shape, dtype)
                self._read_uncast(key, src, out)
                return out
            return self._cast(key, src, info, dtype)
        finally:
            self._finished()

    def _runs(self, key: str, src: str, info: Any, run_bytes: int,
              buffer: Callable[[np.dtype, int], np.ndarray]) -> Iterator[np.ndarray]:
        """The value's stored elements in C order, flat, in runs of at most ``run_bytes``
        (at least one element), each verified before it is yielded; ``buffer(dtype, n)``
        gives the array a run is read into. The progress bar counts output bytes."""
        stored = np.dtype(info.dtype)
        ratio = self._target(stored).itemsize / stored.itemsize
        size = math.prod(info.shape)
        if isinstance(self._reader, cv.storage.SupportsRuns) and size:
            step = max(1, run_bytes // stored.itemsize)
            for start in range(0, size, step):
                run = buffer(stored, min(step, size - start))
                self._reader.read_run_into(src, start, run, verify=True)
                # the last run completes the value (so a full bar counts every value)
                self._progress.update(int(run.nbytes * ratio), key,
                                      values=int(start + step >= size))
                yield run
            return
        counted = self._progress.bytes_of(key)
        for _, block in value_blocks(self._reader, src, info,
                                     lambda n: counted(int(n * ratio))):
            yield block.reshape(-1)
        if size > _blocks.BLOCK_ELEMENTS and info.checksum is not None:
            self._reader.verify(src)  # the blocks were read unverified
        self._progress.update(0, key)

    def _cast_run(self, key: str, run: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """``run`` cast to ``dtype``, counting in ``lost[key]`` the elements the cast turned
        into another value class: finite ones out of the range (inf, or NaN in a type with
        no inf) and infinities a type without them holds as NaN."""
        with np.errstate(over="ignore", invalid="ignore"):
            cast = run.astype(dtype)
            if is_floating(run.dtype) and not _holds_range(run.dtype, dtype):
                # only elements beyond the target's largest value can change class: a
                # cheap pass over the source picks them (none, nearly always)
                over = np.abs(run) > _largest(dtype)
                if over.any():
                    src, out = run[over], cast[over]
                    n = int(np.count_nonzero(np.isfinite(src) & ~np.isfinite(out))
                            + np.count_nonzero(np.isinf(src) & np.isnan(out)))
                    if n:
                        self.lost[key] = self.lost.get(key, 0) + n
        return cast

    def _cast(self, key: str, src: str, info: Any, dtype: np.dtype) -> np.ndarray:
        """The value read and cast into memory, in runs of about a million elements (so
        the bar moves within a large value, and the stored run is small beside it)."""
        out = np.empty(tuple(info.shape), dtype)
        flat = out.reshape(-1)
        pos = 0
        run_bytes = _blocks.BLOCK_ELEMENTS * np.dtype(info.dtype).itemsize
        for run in self._runs(key, src, info, run_bytes, lambda d, n: np.empty(n, d)):
            flat[pos : pos + run.size] = self._cast_run(key, run, dtype)
            pos += run.size
        return out

    def _spooled(self, key: str, src: str, info: Any, dtype: np.dtype) -> np.ndarray:
        """The value written into the spool run by run (cast, when asked); its view there.

        A reader that can read a value only whole (a multi-process checkpoint's) fills
        the spool through its mapping instead."""
        spool = self._spool
        assert spool is not None
        shape = tuple(info.shape)
        offset = spool.place(math.prod(shape) * dtype.itemsize)
        stored = np.dtype(info.dtype)
        if (dtype == stored and isinstance(self._reader, cv.storage.SupportsReadIntoMany)
                and not isinstance(self._reader, cv.storage.SupportsRuns)):
            out = spool.view(offset, dtype, shape)
            self._reader.read_into_many([(src, out)], verify=True)
            self._progress.update(out.nbytes, key)
            return out
        # a cast run is as large as the output's share of the piece
        run_bytes = max(1, spool.piece * stored.itemsize // max(stored.itemsize,
                                                                   dtype.itemsize))
        pos = offset
        for run in self._runs(key, src, info, run_bytes, spool.buffer):
            pos = spool.write(pos, run if dtype == stored else self._cast_run(key, run, dtype))
        spool.flush()  # every byte in the file before the writer may look
        return spool.view(offset, dtype, shape)

    def _read_uncast(self, key: str, src: str, out: np.ndarray) -> None:
        """One verified pass, read by position straight into ``out`` (parallel reads and
        hashing, as ``cv.load``; the source is never mapped); a value of more than
        ``RUN_BYTES`` in runs, each verified by its blocks' checksums, so the bar moves."""
        flat = out.reshape(-1)
        if out.nbytes > RUN_BYTES and isinstance(self._reader, cv.storage.SupportsRuns):
            step = max(1, RUN_BYTES // out.dtype.itemsize)
            for start in range(0, flat.size, step):
                run = flat[start : start + step]
                self._reader.read_run_into(src, start, run, verify=True)
                self._progress.update(run.nbytes, key, values=int(start + step >= flat.size))
        else:
            self._reader.read_into_many([(src, out)], verify=True)
            self._progress.update(out.nbytes, key)

    def _finished(self) -> None:
        last = self._given == len(self._plan)
        if self._spool is not None:
            self._spool.release()
            if last:  # the writer writes next: the buffers are not needed any more
                self._spool.drop_buffers()
                self._spool.hand_over()
        if last and self._finishing:
            self._progress.note(self._finishing)

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def _rename(key: str, renames: list[tuple[re.Pattern[str], str]]) -> str:
    new = key
    for pattern, repl in renames:
        try:
            new = pattern.sub(repl, new)
        except re.error as exc:  # a bad group reference in TO, e.g. \2 with one group
            raise UsageError(f"--rename {pattern.pattern}={repl}: {exc}") from None
    if not new and new != key:  # an empty key SRC holds is kept: the output may take it
        raise UsageError(f"--rename maps {key!r} to an empty key")
    return new


def _parse_size(text: str) -> int:
    """``512M``, ``2G``, ``65536`` -> bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size (like 512M or 2G): {text!r}")
    return int(float(m[1]) * units[m[2].upper()])


def _unwritable(dst: Path, fmt: str | None,
                kinds: set[tuple[np.dtype, int]]) -> dict[tuple[np.dtype, int], str]:
    """The ``(dtype, count)`` the output format refuses, each with the writer's reason.

    Asked of the format itself: a value of each dtype, of ``count`` zeros, is saved to a
    scratch directory through ``cv.save``, so the answer is the writer's own.
    """
    refused: dict[tuple[np.dtype, int], str] = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-probe-") as tmp:
        for i, (dtype, count) in enumerate(sorted(kinds, key=str)):
            probe = Path(tmp) / f"probe{i}{dst.suffix}"
            try:
                cv.save(probe, {"x": np.zeros((count,), dtype)}, format=fmt, durable=False)
            except (cv.UnsupportedFormatError, TypeError) as exc:
                refused[dtype, count] = one_line(exc)
            except (cv.CkptError, ValueError, OSError):
                pass  # not about the dtype: the real conversion reports it
    return refused


def _refuse_metadata(dst: Path, fmt: str | None, metadata: dict[str, Any]) -> None:
    """Stop before anything is read when the output format cannot store SRC's metadata
    (an integer beyond 64 bits in a msgpack root record): it is saved once, beside an
    empty value, to a scratch directory, so the answer is the writer's own."""
    if not metadata:
        return
    with tempfile.TemporaryDirectory(prefix="ckpt-probe-") as tmp:
        probe = Path(tmp) / f"metadata{dst.suffix}"
        try:
            cv.save(probe, {"x": np.zeros((0,), np.uint8)}, format=fmt, metadata=metadata,
                    durable=False)
        except TypeError as exc:
            said = one_line(exc).replace(repr(str(probe)), repr(str(dst)))
            raise UsageError(f"{said.rstrip('.')}; pass --no-metadata to leave SRC's metadata "
                             "out") from None
        except (cv.CkptError, ValueError, OSError):
            pass  # not about the metadata: the real conversion reports it


def _probe_count(dtype: np.dtype, count: int) -> int:
    """The element count that tells whether a format takes ``count`` values of ``dtype``:
    0, but for a sub-byte type (a format may pack it, needing whole bytes: safetensors'
    F4 and F6) the count modulo 8, which keeps what byte boundaries depend on."""
    return count % 8 if _sub_byte(dtype) else 0


@functools.cache
def _sub_byte(dtype: np.dtype) -> bool:
    """Whether ``dtype``'s values have fewer than 8 bits (ml_dtypes' int4, float4, ...)."""
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            return int(info(dtype).bits) < 8
        except (ValueError, TypeError):
            continue
    return False


def _refuse_dtypes(dst: Path, args: argparse.Namespace, out_dtypes: dict[str, np.dtype],
                   counts: dict[str, int]) -> None:
    """Stop before anything is written when the output format cannot store some dtype, or
    some value of a packed sub-byte type at its element count."""
    kind = {k: (d, _probe_count(d, counts[k])) for k, d in out_dtypes.items()}
    refused = _unwritable(dst, args.format, set(kind.values()) | {(d, 0) for d in out_dtypes.values()})
    if not refused:
        return
    fmt = args.format or (dst.suffix.lstrip(".") or "the output format")
    bad = {k: d for k, d in out_dtypes.items() if (d, 0) in refused}
    if bad:
        raise _dtype_error(fmt, bad)
    keys = [k for k in out_dtypes if kind[k] in refused]
    shown = "; ".join(f"{k!r} ({out_dtypes[k].name}, {counts[k]} elements)" for k in keys[:10])
    more = f"; and {len(keys) - 10} more" if len(keys) > 10 else ""
    raise UsageError(
        f"{fmt} cannot store {len(keys)} value{'s' if len(keys) != 1 else ''} at "
        f"{'their' if len(keys) != 1 else 'its'} element count: {shown}{more} (it packs "
        "sub-byte values, and each value must end at a byte boundary); leave "
        f"{'them' if len(keys) != 1 else 'it'} out "
        f"with {' '.join(_exclude_option(k) for k in keys[:3])}"
        f"{' ...' if len(keys) > 3 else ''}"
    )


def _exclude_option(key: str) -> str:
    """``--exclude GLOB`` that leaves out exactly ``key``, quoted for a shell: the glob's
    own characters in the key (``*``, ``?``, ``[``) are matched literally (``[[]``).

    >>> _exclude_option("layers[0]/w*")
    "--exclude 'layers[[]0]/w[*]'"
    """
    return "--exclude " + shlex.quote(re.sub(r"([*?[])", r"[\1]", key))


def _dtype_error(fmt: str, bad: dict[str, np.dtype]) -> UsageError:
    keys = list(bad)
    shown = ", ".join(f"{k!r} ({bad[k].name})" for k in keys[:10])
    more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
    hint = " ".join(_exclude_option(k) for k in keys[:3])
    text = (
        f"{fmt} cannot store the dtype of {len(keys)} value{'s' if len(keys) != 1 else ''}: "
        f"{shown}{more}; leave {'them' if len(keys) != 1 else 'it'} out with {hint}{' ...' if len(keys) > 3 else ''}"
    )
    if any(is_floating(d) for d in bad.values()):
        text += f" or cast floating values with --dtype (one of {', '.join(_FLOAT_TARGETS)})"
    return UsageError(text)


def run(args: argparse.Namespace, out: TextIO) -> int:
    args.src = latest_or_path(args.src)
    if is_url(args.src) or is_url(args.dst):
        # An object store: read by ranged GETs, written as a committed step (streamed up).
        if args.src == args.dst:
            raise UsageError(f"source and destination are the same path {args.src!r}")
        with open_checkpoint(args.src) as reader:
            return _convert(reader, args.src, args.dst, args, out)
    src, dst = Path(args.src), Path(args.dst)
    if src.resolve() == dst.resolve():
        raise UsageError(f"source and destination are the same path {str(src)!r}")
    if (dst.exists() or dst.is_symlink()) and not args.force:
        raise UsageError(f"{str(dst)!r} exists; pass --force to replace it")
    with open_checkpoint(src) as reader:
        _refuse_replacing_src(src, dst, reader.format)
        return _convert(reader, src, dst, args, out)


def _refuse_replacing_src(src: Path, dst: Path, fmt: str) -> None:
    """An existing DST that holds SRC (a model folder around one of its shards), or that
    is one of SRC's files (a folder's ``model.safetensors``, a shard beside the index
    SRC names, a TensorFlow prefix's data file), would be replaced with SRC's files in
    it: the conversion would destroy its own source."""
    if not (dst.exists() or dst.is_symlink()):
        return
    s, d = src.resolve(), dst.resolve()
    if s.is_relative_to(d):
        raise UsageError(f"{str(src)!r} lies inside {str(dst)!r}, which --force would replace: "
                         "the conversion would delete its own source; choose another DST")
    if fmt == "hf-safetensors" and s.is_file():  # its index: the shards lie beside it
        s = s.parent
    prefix = re.sub(r"\.(index|data-\d+-of-\d+)$", "", s.name)
    tf_file = fmt == "tf" and d.parent == s.parent and (
        d.name == f"{prefix}.index" or re.fullmatch(re.escape(prefix) + r"\.data-\d+-of-\d+",
                                                     d.name) is not None)
    if d.is_relative_to(s) or tf_file:
        raise UsageError(f"{str(dst)!r} is part of the source {str(src)!r}: --force would "
                         "replace it with the conversion of itself; choose a DST outside it")


@dataclass
class _Plan:
    """What a conversion writes: new key -> source key, kept attributes, output dtypes, sizes."""

    keys: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # source key -> elements
    total: int = 0
    largest: int = 0
    spool_size: int = 0


def _refuse_unreadable(skipped: dict[str, str], src: Path | str, args: argparse.Namespace) -> None:
    """Without --skip-unreadable, values that cannot be read as numbers stop the conversion."""
    if skipped and not args.skip_unreadable:
        shown = "; ".join(f"{k!r}: {v.rstrip('.')}" for k, v in list(skipped.items())[:5])
        more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        raise UsageError(
            f"{len(skipped)} value{'s' if len(skipped) != 1 else ''} of {str(src)!r} cannot be "
            f"read as numbers: {shown}{more}; pass --skip-unreadable to convert the rest"
        )


def _make_plan(reader: Any, keys: list[str], args: argparse.Namespace) -> _Plan:
    plan = _Plan()
    for key in keys:
        new = _rename(key, args.rename)
        if new in plan.keys:
            raise UsageError(f"--rename maps both {plan.keys[new]!r} and {key!r} to {new!r}")
        plan.keys[new] = key
        info = reader.info(key)
        kept = {a: info.attrs[a] for a in _KEPT_ATTRS if a in (info.attrs or {})}
        if kept:
            plan.attrs[new] = kept
        dtype = np.dtype(info.dtype)
        if args.dtype is not None and is_floating(dtype):
            dtype = args.dtype
        plan.dtypes[key] = dtype
        plan.counts[key] = math.prod(info.shape)
        nbytes = math.prod(info.shape) * dtype.itemsize
        plan.total += nbytes
        plan.spool_size += (nbytes + 63) & -64
        plan.largest = max(plan.largest, nbytes)
    return plan


def _metadata_options(
    reader: Any, dst: Path, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The metadata to write and the save options ``--no-metadata`` asks for."""
    metadata = dict(reader.metadata() or {})
    options: dict[str, Any] = {}
    if args.no_metadata:  # none of ckptvar's own; a Hugging Face 'format' entry stays
        metadata = {k: v for k, v in metadata.items() if k == "format" and isinstance(v, str)}
        if _writes_safetensors(dst, args):
            options["ckptvar_metadata"] = False  # not even the per-value attributes
    metadata.update(dict(args.metadata))
    if args.max_shard_size is not None:
        if cv.storage.backend_for(dst, args.format, mode="w").name != "hf-safetensors":
            raise UsageError("--max-shard-size applies to --format hf-safetensors only")
        options["max_shard_size"] = args.max_shard_size
    return metadata, options


def _tuples_as_lists(metadata: dict[str, Any]) -> list[str]:
    """Make every tuple in ``metadata``'s values a list, in place (an optimizer's ``betas``
    in a DCP checkpoint: no format written here stores tuples); the keys changed."""

    def lists(value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [lists(v) for v in value]
        if isinstance(value, dict):
            return {k: lists(v) for k, v in value.items()}
        return value

    def holds_tuple(value: Any) -> bool:
        if isinstance(value, tuple):
            return True
        if isinstance(value, list):
            return any(map(holds_tuple, value))
        return isinstance(value, dict) and any(map(holds_tuple, value.values()))

    changed = [k for k, v in metadata.items() if holds_tuple(v)]
    for k in changed:
        metadata[k] = lists(metadata[k])
    return changed


def _pack_option(out_format: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--pack-threshold`` as a save option (only ckptvar's own formats pack)."""
    if args.pack_threshold is None:
        return {}
    if out_format not in ("h5", "zarr"):
        raise UsageError(f"--pack-threshold applies to .h5 and .zarr outputs, not {out_format}")
    return {"pack_threshold": args.pack_threshold}


def _writes_safetensors(dst: Path, args: argparse.Namespace) -> bool:
    """Whether DST is a safetensors file or a Hugging Face sharded safetensors folder."""
    name = cv.storage.backend_for(dst, args.format, mode="w").name
    return name in ("safetensors", "hf-safetensors")


def _hf_format(dst: Path, args: argparse.Namespace, metadata: dict[str, Any]) -> bool:
    """Give safetensors output ``format: pt`` unless SRC names another format, as Hugging
    Face's own converter does (transformers refuses a header whose metadata has no
    ``format``). With ``--no-metadata`` and nothing else to write, the header keeps no
    metadata at all, which transformers accepts. True when added."""
    if "format" in metadata or not _writes_safetensors(dst, args):
        return False
    if args.no_metadata and not metadata:
        return False
    metadata["format"] = "pt"
    return True


def _convert(
    reader: Any, src: Path | str, dst_arg: Path | str, args: argparse.Namespace, out: TextIO
) -> int:
    remote_dst = is_url(dst_arg)
    dst = Path(dst_arg)  # a URL's name and suffix only: nothing local is made for it
    # cv.save's own refusal of a destination no writer takes, before anything is read
    out_format = cv.storage.backend_for(dst_arg, args.format, mode="w").name
    skipped = {k: v for k, v in reader.skipped.items() if selected(k, args)}
    keys = select(reader, args, where=repr(str(src)), allow_empty=bool(skipped))
    _refuse_unreadable(skipped, src, args)
    p = _make_plan(reader, keys, args)
    plan, attrs, out_dtypes = p.keys, p.attrs, p.dtypes
    total, largest, spool_size = p.total, p.largest, p.spool_size
    if not plan:
        raise UsageError(f"nothing to convert: {str(src)!r} has no value left to convert")
    _refuse_dtypes(dst, args, out_dtypes, p.counts)
    show = (
        args.progress
        if args.progress is not None
        else (sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES and not args.quiet)
    )
    metadata, options = _metadata_options(reader, dst, args)
    tupled = _tuples_as_lists(metadata)
    options.update(_pack_option(out_format, args))
    added_format = _hf_format(dst, args, metadata)
    _refuse_metadata(dst, args.format, metadata)
    window = args.window if args.window is not None else max(DEFAULT_WINDOW, 2 * largest)
    created = [] if remote_dst else _make_parents(dst)
    if remote_dst:
        options["storage_options"] = storage_options()
    try:
        with (
            Progress(total, stream=sys.stderr, enabled=bool(show)) as progress,
            _spool(dst, spool_size if total > window else 0, window,
                   local=not remote_dst) as spool,
        ):
            finishing = (f"writing {escape(dst_arg)} and syncing it to disk ..."
                         if not remote_dst else f"uploading {escape(dst_arg)} ...")
            values = _Converted(reader, plan, args.dtype, progress, spool,
                                finishing=finishing)
            try:
                written = cv.save(
                    dst_arg if remote_dst else dst,
                    values,
                    format=args.format,
                    attrs=attrs or None,
                    metadata=metadata or None,
                    **options,
                )
            except OSError as exc:
                if isinstance(exc, cv.CkptError):
                    raise
                detail = exc.strerror or one_line(exc)
                if str(dst_arg) not in detail:  # cv.save's errors name DST already
                    detail = f"cannot write {str(dst_arg)!r}: {detail}"
                raise UsageError(detail) from None
    except BaseException:
        for d in reversed(created):  # only the folders this conversion made, if still empty
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    n = len(plan)
    print(
        f"Wrote {n} value{'s' if n != 1 else ''} ({human_size(total)}) from "
        f"{escape(src)} ({escape(reader.format)}) to {escape(written)}",
        file=out,
    )
    _say_lost(values.lost, reader, plan, args.dtype)
    _say_notes(out, added_format, tupled, skipped)
    _say_changed(out, reader, plan)
    return EXIT_OK


def _say_changed(out: TextIO, reader: Any, plan: dict[str, str]) -> None:
    """Name the values written in another dtype or shape than the source stores them
    (``reader.changed``: a packed torch ``float4_e2m1fn_x2`` tensor unpacked)."""
    changed = [(key, reader.changed[src]) for key, src in plan.items() if src in reader.changed]
    if not changed:
        return
    shown = "; ".join(f"{k!r}: {how.rstrip('.')}" for k, how in changed[:5])
    more = f"; and {len(changed) - 5} more" if len(changed) > 5 else ""
    print(f"Unpacked {len(changed)} value{'s' if len(changed) != 1 else ''} stored in a "
          f"packed dtype (written in another dtype and shape): {escape(shown + more)}",
          file=out)


def _say_notes(out: TextIO, added_format: bool, tupled: list[str],
               skipped: dict[str, str]) -> None:
    """What the conversion added, changed or left out, after the count of values written."""
    if added_format:
        print("Added the metadata entry format=pt, as Hugging Face loaders require", file=out)
    if tupled:
        names = ", ".join(repr(k) for k in tupled[:5]) + (" ..." if len(tupled) > 5 else "")
        print(f"Stored {len(tupled)} metadata value{'s' if len(tupled) != 1 else ''} holding "
              f"tuples with each tuple as a list (no format written here has tuples): "
              f"{escape(names)}", file=out)
    if skipped:
        names = ", ".join(repr(k) for k in list(skipped)[:5]) + (" ..." if len(skipped) > 5 else "")
        print(
            f"Left out {len(skipped)} unreadable value{'s' if len(skipped) != 1 else ''} "
            f"(--skip-unreadable): {escape(names)}",
            file=out,
        )


def _say_lost(lost: dict[str, int], reader: Any, plan: dict[str, str], dtype: np.dtype) -> None:
    """Warn, naming each value, of the elements a --dtype cast turned into inf or NaN."""
    what = "and became inf" if _holds_inf(dtype) else "or infinite (it has no inf) and became NaN"
    for key, n in lost.items():
        size = math.prod(reader.info(plan[key]).shape)
        print(
            f"ckpt: warning: {escape(repr(key))}: {n} of {size} values are out of "
            f"{dtype.name}'s range {what} (--dtype {dtype.name})",
            file=sys.stderr,
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


def _make_parents(dst: Path) -> list[Path]:
    """Create DST's missing parent folders; returns those made, outermost first."""
    missing = []
    parent = dst.absolute().parent
    for above in (parent, *parent.parents):
        if above.exists() or above.is_symlink():
            if not above.is_dir():
                raise UsageError(
                    f"cannot write {str(dst)!r}: {str(above)!r} is a file, not a folder"
                )
            break
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    missing.reverse()
    for d in missing:
        try:
            d.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            for made in reversed(missing[: missing.index(d)]):  # leave nothing half-made
                with contextlib.suppress(OSError):
                    made.rmdir()
            raise UsageError(
                f"cannot create the folder {str(d)!r} for {str(dst)!r}: "
                f"{exc.strerror or one_line(exc)}"
            ) from None
    return missing


#: How often the spool's pages are released from the process while a conversion runs (s).
TRIM_INTERVAL = 0.005
#: The most bytes read (and cast) at once on their way into the spool (two such pieces
#: are in flight: one being read, one being written).
PIECE_BYTES = 8 << 20


def _reserve(fd: int, nbytes: int) -> None:
    """Give the scratch file its size, its disk space allocated where the file system can
    (Linux ``fallocate``): a full disk fails here, before anything is read, and writing
    into allocated space costs the file system less (measured: 256 MiB in 47 ms, not 60)."""
    fallocate = _libc_fallocate()
    failed = errno.EOPNOTSUPP if fallocate is None else fallocate(fd, nbytes)
    if failed == errno.ENOSPC:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failed:  # no fallocate here: a sparse file, its space taken as it is written
        os.ftruncate(fd, nbytes)


@functools.cache
def _libc_fallocate() -> Callable[[int, int], int] | None:
    """``fallocate(fd, 0, 0, nbytes)`` of libc (Linux; ctypes loaded on first use),
    returning 0 or the errno; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # noqa: PLC0415 - only a streamed conversion needs it

    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int

    def fallocate(fd: int, nbytes: int) -> int:
        return 0 if fn(fd, 0, 0, nbytes) == 0 else ctypes.get_errno()

    return fallocate


def _bytes_written() -> int | None:
    """The bytes this process has written by system calls (``wchar``), or None."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class _Spool:
    """A scratch file beside DST, written by ``pwrite`` and mapped (shared) for the writer.

    Values are read into one of two buffers of ``piece`` bytes and written into the file
    from there by ``pwrite`` on a thread of the spool's own, while the next piece is read
    into the other buffer. ``pwrite`` puts the bytes in the page cache without mapping a
    page into the process: filling the mapping itself would fault each 4 KiB page in and
    dirty it through the file system (twice the time, measured), and each page would
    count in the process's resident size. The writer reads the values through the
    mapping; every ``TRIM_INTERVAL`` a thread calls :meth:`tick`, which releases the
    mapping's pages from the process (``madvise(MADV_DONTNEED)``: the bytes stay in the
    file and the page cache, and come back on the next access) but for those the writer
    is reading, so the process's resident size tracks what the writer touches now, not
    the whole output.
    """

    def __init__(self, fd: int, nbytes: int, piece: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.piece = piece
        self._mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        self._bytes = np.frombuffer(self._mapped, dtype=np.uint8)
        self._next = 0
        self._buffers: list[np.ndarray] = []
        self._turn = 0  # the buffer the next piece is read into
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-convert-spool")
        self._pending: Future[None] | None = None  # the write in flight (at most one)
        #: Bytes written into the file by ``pwrite`` (each output byte once).
        self.written = 0
        #: The process's written-bytes count when the writer took over (None: not yet).
        self._writer_base: int | None = None

    def place(self, nbytes: int) -> int:
        """Room for ``nbytes`` more (64-byte aligned, as NumPy's own buffers); its offset."""
        offset = self._next
        self._next += (nbytes + 63) & -64
        return offset

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The value at ``offset``, as an array over the mapping (no page is touched)."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self._bytes[offset : offset + nbytes].view(dtype).reshape(shape)

    def buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A flat array of ``count`` elements (at most ``piece`` bytes) in the buffer that
        no write is using."""
        while len(self._buffers) <= self._turn:
            self._buffers.append(np.empty(self.piece, np.uint8))
        return self._buffers[self._turn][: count * dtype.itemsize].view(dtype)

    def write(self, offset: int, array: np.ndarray) -> int:
        """Write ``array``'s bytes (C order) at ``offset`` on the spool's thread, once the
        write before it is done; returns the offset after them. :meth:`flush` waits."""
        self.flush()
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        self._pending = self._pool.submit(self._pwrite, offset, data)
        self._turn ^= 1  # the next piece goes into the other buffer
        return offset + len(data)

    def _pwrite(self, offset: int, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)
        self.written += done

    def flush(self) -> None:
        """Wait for the write in flight (raising its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def drop_buffers(self) -> None:
        """Free the buffers (once every value is in the file: no write is in flight)."""
        if self._pending is None:
            self._buffers.clear()

    def release(self) -> None:
        """Drop the mapping's pages from the process (they stay in the file)."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux, macOS
            self._mapped.madvise(mmap.MADV_DONTNEED)

    def hand_over(self) -> None:
        """Every value is in the file: from now on :meth:`tick` follows the writer."""
        self._writer_base = _bytes_written()

    def tick(self) -> None:
        """Keep mapped only the part of the file the writer is at (or release everything).

        The writer writes the values in the order they were given, so the bytes the
        process has written since :meth:`hand_over` (``/proc/self/io``) tell where it is
        in the file. What lies behind that point is released, and what lies more than two
        pieces (half the window at most) ahead of it (what the writer's checksum thread
        mapped); the pages in between stay mapped: released under a ``write`` in
        progress, the kernel copies the rest of that call in ever smaller chunks
        (measured on 256 MiB from unmapped pages: the ``write`` twice as long, and the
        destination's ``fsync`` longer too). Where that count is not known, everything
        is released. (Mapping the next pages in advance, ``MADV_POPULATE_READ``, was
        measured too: 10 ms less for ``.safetensors``, but ``.h5`` writes then took up to
        four times as long now and then, the writer and its checksum thread waiting.)
        """
        written = None if self._writer_base is None else _bytes_written()
        if written is None or self._writer_base is None or not hasattr(mmap, "MADV_DONTNEED"):
            self.release()
            return
        page = mmap.PAGESIZE
        at = min(self.nbytes, max(0, written - self._writer_base)) // page * page
        ahead = min(self.nbytes, at + 2 * self.piece)
        if at:
            self._mapped.madvise(mmap.MADV_DONTNEED, 0, at)
        if ahead < self.nbytes:
            self._mapped.madvise(mmap.MADV_DONTNEED, ahead, self.nbytes - ahead)

    def close(self) -> None:
        """Stop the thread; unmap the file now, unless a value over it is still referenced
        (then when the last one goes)."""
        with contextlib.suppress(OSError):
            self.flush()
        self._pool.shutdown(wait=True)
        self._buffers.clear()
        self._bytes = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            self._mapped.close()


@contextlib.contextmanager
def _spool(dst: Path, nbytes: int, window: int, *, local: bool = True) -> Iterator[_Spool | None]:
    """A :class:`_Spool` of ``nbytes`` beside DST (``None`` when 0), its buffer a quarter of
    ``window`` (1 to 8 MiB), its pages released by a thread while it is in use.

    The file's name is removed at once (it lives while it is open), so nothing is left
    behind whatever happens, a killed process included. At the end the file is unmapped
    and closed on a thread of its own: the kernel frees its pages then (some 15 ms per
    256 MiB), while the conversion reports and the process exits.
    """
    if nbytes == 0:
        yield None
        return
    where = dst.absolute().parent if local else None  # a URL: the temporary directory
    # the scratch file's name within 255 bytes (mkstemp adds 8 characters), however long DST's
    stem = dst.name.encode("utf-8", "surrogateescape")[:255 - 16].decode("utf-8", "ignore")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{stem}.spool-", dir=where)
    except OSError as exc:  # named after DST: the scratch file is the conversion's own
        raise UsageError(f"cannot write {str(dst)!r}: the scratch file a streamed conversion "
                         f"makes beside it: {exc.strerror or one_line(exc)}") from None
    stop = threading.Event()
    trimmer: threading.Thread | None = None
    spool: _Spool | None = None
    try:
        os.unlink(name)
        try:
            _reserve(fd, nbytes)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            beside = "beside it" if local else f"in {tempfile.gettempdir()}"
            raise UsageError(
                f"cannot write {str(dst)!r}: no space left for the scratch file of "
                f"{human_size(nbytes)} {beside} that a streamed conversion needs; free some, "
                "or give --window more than the output to build it in memory"
            ) from None
        spool = _Spool(fd, nbytes, min(PIECE_BYTES, max(1 << 20, window // 4)))

        def trim(spool: _Spool = spool) -> None:
            while not stop.wait(TRIM_INTERVAL):
                spool.tick()

        trimmer = threading.Thread(target=trim, name="ckpt-convert-trim", daemon=True)
        trimmer.start()
        yield spool
    finally:
        stop.set()
        if trimmer is not None:
            trimmer.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)  # when the failure came before the unlink above
        if spool is not None:
            spool.close()
        threading.Thread(target=os.close, args=(fd,), name="ckpt-convert-spool-close",
                         daemon=True).start()
