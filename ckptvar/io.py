"""Loading and inspection: the public functions over every registered format.

``list_variables``, ``load_variable``, ``load`` and ``open`` read ckptvar's own
``.h5``/``.zarr`` checkpoints and, read-only, the foreign formats (API.md §7);
``save`` writes a plain ckptvar checkpoint from a dict of arrays.

>>> import numpy as np, ckptvar as cv
>>> _ = cv.save("demo.h5", {"w": np.arange(3, dtype=np.float32)})
>>> cv.list_variables("demo.h5")
[('w', (3,), dtype('float32'))]
>>> cv.load("demo.h5")["w"]
array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import _frameworks
from ._staging import fill_device, to_writable, upload
from .checkpoint import (
    is_plain,
    latest_checkpoint,
    load_tree,
    save_tree,
    write_values,
)
from .device import resolve, supports_dtype, xp_for
from .errors import CheckpointNotFoundError, DeviceError, UnsupportedFormatError
from .locations import is_url
from .storage import backend_for, open_remote_reader, paused_gc, remote_format, save_remote
from .storage.base import Reader, SupportsRuns

__all__ = ["list_variables", "load", "load_variable", "open", "save"]

PathLike = str | os.PathLike[str]
Options = Mapping[str, Any] | None


def open(
    path: PathLike, *, format: str | None = None, storage_options: Options = None
) -> Reader:
    """A read-only mapping from key to a lazy array; use it as a context manager.

    ``reader[key]`` costs no I/O; ``reader[key][0:10]`` reads only those rows;
    ``reader.read(key, out=buf)`` reads a whole value into ``buf``, verified.
    ``path`` may be an object-store URL (``s3://bucket/run/ckpt-3.h5``, a committed
    step; ranged GETs only), with ``storage_options`` for its client.
    """
    if is_url(path):
        return open_remote_reader(str(path), format, storage_options)
    p = Path(path)
    return backend_for(p, format).open_reader(p)


def _open_file_or_latest(path: PathLike, storage_options: Options) -> Reader:
    """``open(path)``; a directory (or an object-store prefix) that is no checkpoint but
    holds some (a manager's, a ``Saver``'s) stands for its latest checkpoint, as
    TensorFlow's ``ckpt_dir_or_file``."""
    try:
        return open(path, storage_options=storage_options)
    except (UnsupportedFormatError, CheckpointNotFoundError):
        if is_url(path):
            latest = latest_checkpoint(path, storage_options=storage_options)
        else:
            latest = latest_checkpoint(path) if Path(path).is_dir() else None
        if latest is None:
            raise
    return open(latest, storage_options=storage_options)


def list_variables(
    path: PathLike, *, storage_options: Options = None
) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``[(key, shape, dtype), ...]`` of every value stored at ``path``, in file order.

    ``path`` may also be a directory of checkpoints: its latest (``cv.latest_checkpoint``).
    """
    with _open_file_or_latest(path, storage_options) as reader:
        out = []
        for key in reader.keys():  # noqa: SIM118 - a Reader is no dict
            info = reader.info(key)
            out.append((key, tuple(info.shape), info.dtype))
        return out


def load_variable(
    path: PathLike, key: str, *, verify: bool = True, storage_options: Options = None
) -> np.ndarray:
    """One stored value as a NumPy array (checksum verified unless ``verify=False``);
    ``path`` may be a directory of checkpoints, as for :func:`list_variables`."""
    with _open_file_or_latest(path, storage_options) as reader:
        return reader.read(key, verify=verify)


def load(
    path: PathLike,
    *,
    device: Any = None,
    keys: Iterable[str] | None = None,
    verify: bool = True,
    storage_options: Options = None,
    like: Any = "numpy",
    coordinator: Any = None,
    timeout: float | None = None,
    cast: bool = False,
) -> Any:
    """Every value (or only ``keys``) as ``{key: array}``.

    ``like=tree`` (a dict/list/tuple/namedtuple of arrays and Python values) returns
    ``tree``'s structure read from ``path``, the values stored under the ``/``-joined
    paths, each array of its like's kind (docs/frameworks.md): a ``DTensor`` is filled
    in place, a ``jax.Array`` or ``jax.ShapeDtypeStruct(..., sharding=)`` gives a
    ``jax.Array`` with that sharding. Shapes and dtypes must match (``cast=True``
    converts same-kind dtypes); nothing is loaded unless everything is. With
    ``coordinator`` (or sharded likes) every process calls it and reads only the boxes
    it needs.

    ``like="torch" | "jax" | "cupy"`` gives that framework's arrays instead of NumPy's
    (``"cupy"`` implies ``device="GPU:0"`` unless ``device=`` says otherwise); the
    conversion shares memory where the framework allows (docs/guide.md, "Framework arrays").
    ``like="torch", device="cuda:0"`` gives CUDA tensors of every dtype (bfloat16 too).

    ``device=None`` gives NumPy arrays; ``device="GPU:0"`` (or ``"cuda:0"``) gives CuPy
    arrays on that GPU. From ckptvar's own files each value goes through one reused,
    double-buffered pinned host buffer (two halves of ``CKPTVAR_STAGING_BYTES``, 64 MiB
    each): a piece is read and verified (by the blocks that hold it) into one half while
    the other half is copied to the device, so host memory never holds more than the
    buffer. From other formats each value is read to the host and copied.
    """
    if not isinstance(like, str) or coordinator is not None:
        return load_tree(path, like, coordinator, timeout, verify, cast, storage_options)
    _frameworks.check_like(like)
    dev = None if device is None else resolve(device)
    if like == "torch" and dev is not None and dev.is_gpu:
        with open(path, storage_options=storage_options) as reader:
            wanted = list(reader.keys()) if keys is None else list(keys)
            return _load_to_torch_gpu(reader, wanted, dev, verify)
    if like != "numpy":
        if like == "cupy" and device is None:
            device = "GPU:0"
        arrays = load(path, device=device, keys=keys, verify=verify,
                      storage_options=storage_options)
        for key, value in arrays.items():
            arrays[key] = _frameworks.from_numpy(value, like, what=f"{key!r} in {str(path)!r}")
        return arrays
    dev = None
    if device is not None:
        dev = resolve(device)
        if not dev.is_gpu:
            dev = None
    with open(path, storage_options=storage_options) as reader:
        wanted = list(reader.keys()) if keys is None else list(keys)
        _say_not_as_stored(path, reader, wanted, whole=keys is None)
        if dev is None:
            with paused_gc():
                return dict(reader.read_many(wanted, verify=verify))
        return _load_to_gpu(reader, wanted, dev, verify)


def _say_not_as_stored(path: PathLike, reader: Reader, wanted: list[str], *,
                       whole: bool) -> None:
    """Warn of the values a load leaves out (``whole``: every key asked for) and of those
    of ``wanted`` it gives in another dtype or shape than stored."""
    said = []
    if whole and reader.skipped:
        said.append(("leaves out", "that cannot be read as numeric arrays", reader.skipped))
    changed = {k: reader.changed[k] for k in wanted if k in reader.changed}
    if changed:
        said.append(("gives", "in another dtype or shape than the file stores", changed))
    for does, which, values in said:  # never silent: each said once, the first ten named
        shown = "; ".join(f"{k!r} ({why.rstrip('.')})" for k, why in list(values.items())[:10])
        more = f"; and {len(values) - 10} more" if len(values) > 10 else ""
        warnings.warn(f"cv.load({str(path)!r}) {does} {len(values)} value(s) {which}: "
                      f"{shown}{more}.", UserWarning, stacklevel=3)


def _load_to_gpu(reader: Reader, keys: list[str], dev: Any, verify: bool) -> dict[str, Any]:
    cp = xp_for(dev)
    out: dict[str, Any] = {}
    if isinstance(reader, SupportsRuns):  # through the pinned buffer, a piece at a time
        with cp.cuda.Device(dev.index):
            for key in keys:
                info = reader.info(key)
                _check_gpu_dtype(dev, key, info.dtype)
                arr = cp.empty(info.shape, info.dtype)
                fill_device(reader, key, arr, verify=verify)
                out[key] = arr
        return out
    with cp.cuda.Device(dev.index):
        stream = cp.cuda.Stream(non_blocking=True)
        for key, host in reader.read_many(keys, verify=verify):
            _check_gpu_dtype(dev, key, host.dtype)
            arr = cp.empty(host.shape, host.dtype)
            # From pageable memory cudaMemcpyAsync returns once the bytes are staged for
            # DMA, so ``host`` may be freed right after; only the device copy is pending.
            arr.set(host, stream=stream)
            out[key] = arr
            del host
        stream.synchronize()
    return out


def _load_to_torch_gpu(reader: Reader, keys: list[str], dev: Any,
                       verify: bool) -> dict[str, Any]:
    """CUDA torch tensors (bfloat16 and float8 included), each filled through the pinned
    buffer when the reader reads runs, else copied from its host value."""
    torch = importlib.import_module("torch")
    out: dict[str, Any] = {}
    runs = isinstance(reader, SupportsRuns)
    for key in keys:
        info = reader.info(key)
        probe = _frameworks.from_numpy(np.empty(0, info.dtype), "torch", what=repr(key))
        t = torch.empty(tuple(info.shape), dtype=probe.dtype, device=f"cuda:{dev.index}")
        if runs:
            fill_device(reader, key, t, verify=verify)
        else:
            upload(reader.read(key, verify=verify), t)
        out[key] = t
    return out


def _check_gpu_dtype(dev: Any, key: str, dtype: Any) -> None:
    if not supports_dtype(dev, dtype):
        raise DeviceError(
            f"Cannot load {key!r} ({dtype}) onto {dev}: CuPy has no such dtype; "
            "load it with device=None (NumPy) instead."
        )


def save(
    path: PathLike,
    arrays: Any,
    *,
    format: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Mapping[str, Any]] | None = None,
    storage_options: Options = None,
    coordinator: Any = None,
    timeout: float | None = None,
    **options: Any,
) -> Path | str:
    """Write ``{key: array}`` as a ckptvar checkpoint at ``path`` (atomically); returns the path.

    ``arrays`` may also be a tree (nested dicts, lists, tuples, namedtuples of arrays and
    Python values): each array is stored under its ``/``-joined path, the Python values
    (``None``, numbers, strings) in the metadata with their types (docs/frameworks.md).
    With ``coordinator`` (or sharded arrays: ``DTensor``, multi-process ``jax.Array``)
    every process calls it and writes only the boxes it owns (one checkpoint).

    At an object-store URL the checkpoint becomes a committed step (data, root record,
    then the create-only commit marker) and the URL is returned as a ``str``; a step
    already committed raises ``CheckpointExistsError`` naming it.

    Missing parent directories are created (as ``Checkpoint.save`` does); an
    ``OSError`` names ``path``, never the temporary the file is written to first.

    Each key is also the value's stored ``name`` unless ``attrs[key]`` says otherwise.
    ``options`` go to the format's writer (``durable``, ``pack_threshold``,
    ``compression`` for Zarr; see docs/FORMAT.md).

    Values may be PyTorch tensors, JAX or CuPy arrays: on the CPU their memory is
    written as it is (no copy, bfloat16 included); from a GPU each value is staged
    through a bounded, reused pinned host buffer (``CKPTVAR_STAGING_BYTES``, two halves of 64 MiB),
    never copied to the host whole (docs/frameworks.md).
    """
    if coordinator is not None or not is_plain(arrays):
        if attrs or (coordinator is not None and (options or storage_options)):
            raise TypeError("cv.save of a tree takes no attrs=, and with coordinator= no "
                            "storage_options= or writer options")

        def flat(p: PathLike, host: Mapping[str, Any], meta: Any) -> Path | str:
            return save(p, host, format=format, metadata=meta, storage_options=storage_options,
                        **options)

        return save_tree(path, arrays, format, metadata, coordinator, timeout, flat,  # type: ignore[no-any-return]
                         options=bool(options or storage_options))
    if is_url(path):
        url = str(path)
        fmt = remote_format(url.rsplit("/", 1)[-1], format) or "h5"
        return save_remote(
            url,
            lambda tmp: save(tmp, arrays, format=fmt, metadata=metadata, attrs=attrs, **options),
            storage_options,
        )
    p = Path(path)
    backend = backend_for(p, format, mode="w")

    def values() -> Iterator[tuple[str, Any, dict[str, Any]]]:
        for key, value in arrays.items():
            extra = dict(attrs.get(key, ())) if attrs else {}
            if "name" not in extra:
                extra["name"] = key
            host = value if type(value) is np.ndarray else to_writable(value, what=f"{key!r}")
            yield key, host, extra

    with paused_gc():
        written: Path = write_values(p, backend, values(), metadata, **options)
    return written
