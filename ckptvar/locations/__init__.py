"""Where checkpoint bytes live: local directories and object stores behind one interface.

>>> from ckptvar.locations import open_location, is_url
>>> is_url("s3://bucket/run") and not is_url("/tmp/run")
True
>>> open_location("/tmp/run").url
'/tmp/run'

:func:`open_location` parses a path or URL (a ``str``: ``pathlib.Path`` would
mangle ``s3://``) into a :class:`Location`; :mod:`._commit` makes steps visible by
commit marker. The readers, writers and the manager use only this package's
names; see docs/cloud.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedFormatError
from ._base import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    InvalidKeyError,
    Location,
    ObjectInfo,
    ObjectWriter,
    PositionalRaw,
    StorageError,
)
from ._claim import CLAIM_LEASE, CLAIM_SUFFIX, Claim, Holder, claim, process_alive, read_claim
from ._commit import (
    MARKER_SUFFIX,
    CommitRecord,
    clean_uncommitted,
    commit,
    committed_in_save_order,
    is_committed,
    latest_committed_step,
    list_committed_steps,
    marker_key,
    prune,
    read_commit,
    refuse_committed,
)
from ._leftovers import Leftover, remove_local, staging_leftovers, temporaries, uncommitted
from ._local import LocalLocation
from ._lockwait import LOCK_TIMEOUT, checked_lock_timeout, lock_timeout, wait_for_lock
from ._names import (
    STAGING_PREFIX,
    StepName,
    is_partial,
    parse_staging_name,
    parse_step_name,
    partial_path,
    staging_directory,
    step_name,
    step_number,
    this_host,
)
from ._object import CLOUD_SCHEMES, ObjectStoreLocation, RequestStats
from ._publish import (
    Binding,
    check_destination,
    fsync_all,
    fsync_dir,
    fsync_path,
    no_writer_in,
    publish,
    remove_path,
    temporary_sibling,
    write_atomically,
)
from ._upload import tree_checksum, upload_step, upload_tree

__all__ = [
    "CLAIM_LEASE",
    "CLAIM_SUFFIX",
    "CLOUD_SCHEMES",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "LOCK_TIMEOUT",
    "MARKER_SUFFIX",
    "STAGING_PREFIX",
    "Binding",
    "Claim",
    "CommitRecord",
    "Holder",
    "InvalidKeyError",
    "Leftover",
    "LocalLocation",
    "Location",
    "ObjectInfo",
    "ObjectStoreLocation",
    "ObjectWriter",
    "PositionalRaw",
    "RequestStats",
    "StepName",
    "StorageError",
    "check_destination",
    "checked_lock_timeout",
    "claim",
    "clean_uncommitted",
    "commit",
    "committed_in_save_order",
    "fsync_all",
    "fsync_dir",
    "fsync_path",
    "is_committed",
    "is_partial",
    "is_url",
    "latest_committed_step",
    "list_committed_steps",
    "lock_timeout",
    "marker_key",
    "no_writer_in",
    "open_location",
    "parse_staging_name",
    "parse_step_name",
    "partial_path",
    "process_alive",
    "prune",
    "publish",
    "read_claim",
    "read_commit",
    "refuse_committed",
    "remove_local",
    "remove_path",
    "split_url",
    "staging_directory",
    "staging_leftovers",
    "step_name",
    "step_number",
    "temporaries",
    "temporary_sibling",
    "this_host",
    "tree_checksum",
    "uncommitted",
    "upload_step",
    "upload_tree",
    "wait_for_lock",
    "write_atomically",
]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def open_location(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Location:
    """A :class:`Location` rooted at a local path, ``file://`` URL or object-store URL."""
    if not is_url(path):
        return LocalLocation(path)
    url = str(path)
    scheme = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    if scheme == "file":
        return LocalLocation(url[len("file://") :])
    if scheme in CLOUD_SCHEMES:
        return ObjectStoreLocation(url, storage_options=storage_options)
    raise UnsupportedFormatError(
        f"{url!r}: no storage for the {scheme}:// scheme; supported are local paths, file:// "
        f"and {', '.join(s + '://' for s in CLOUD_SCHEMES)}"
    )


def split_url(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> tuple[Location, str]:
    """The parent location of ``path`` and the key of its last component.

    ``split_url("s3://b/run/ckpt-3.h5")`` → ``(Location("s3://b/run"), "ckpt-3.h5")``: the
    form the commit functions take (a step is a key below a location).
    """
    text = os.fspath(path).rstrip("/")
    parent, _, name = text.rpartition("/")
    if not name or (is_url(text) and parent.endswith(":/")):
        raise InvalidKeyError(
            f"{text!r} has no key below a location (expected .../name, like "
            "s3://bucket/run/ckpt-1.h5)")
    return open_location(parent or ".", storage_options=storage_options), name
