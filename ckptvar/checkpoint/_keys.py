"""Checkpoint keys: object-graph paths joined with ``/`` (pure, no imports from ckptvar).

A key is the path of names from the checkpoint root to a value: attribute names,
list/tuple indices and dict keys, joined with ``/`` (``model/layers/0/kernel``).
A name segment may itself contain ``/`` or ``%``, so each segment is escaped,
percent-style: ``%`` becomes ``%25`` and ``/`` becomes ``%2F``; nothing else changes.
Empty names are refused. How a key is laid out inside an HDF5 file or a Zarr store is
the storage layer's business (docs/FORMAT.md).

>>> join_key(["model", "a/b", "100%"])
'model/a%2Fb/100%25'
>>> split_key("model/a%2Fb/100%25")
['model', 'a/b', '100%']
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["escape_segment", "join_key", "parent_and_name", "split_key", "unescape_segment"]


def escape_segment(name: str) -> str:
    """Escape one name so that it contains no ``/``.

    >>> escape_segment("a/b%c")
    'a%2Fb%25c'
    """
    if not isinstance(name, str):
        raise TypeError(f"A checkpoint name must be a string, got {type(name).__name__} {name!r}.")
    if not name:
        raise ValueError("A checkpoint name segment must not be empty.")
    return name.replace("%", "%25").replace("/", "%2F")


def unescape_segment(segment: str) -> str:
    """Inverse of :func:`escape_segment`.

    >>> unescape_segment("a%2Fb%25c")
    'a/b%c'
    """
    out: list[str] = []
    i = 0
    while i < len(segment):
        ch = segment[i]
        if ch == "%":
            code = segment[i + 1 : i + 3].upper()
            if code == "25":
                out.append("%")
            elif code == "2F":
                out.append("/")
            else:
                raise ValueError(f"Bad escape {segment[i:i + 3]!r} in key segment {segment!r}.")
            i += 3
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def join_key(names: Iterable[str]) -> str:
    """Escape and join raw names into a key."""
    return "/".join(escape_segment(n) for n in names)


def split_key(key: str) -> list[str]:
    """Split a key into its raw (unescaped) names."""
    return [unescape_segment(s) for s in key.split("/")]


def parent_and_name(key: str) -> tuple[str, str]:
    """``("model/dense", "kernel")`` for ``"model/dense/kernel"``; parent ``""`` at the root.

    The name comes back unescaped; the parent stays an (escaped) key.

    >>> parent_and_name("model/a%2Fb")
    ('model', 'a/b')
    """
    parent, _, last = key.rpartition("/")
    return parent, unescape_segment(last)
