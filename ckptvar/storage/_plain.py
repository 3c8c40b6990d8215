"""Plain msgpack values in the root record: the checks they pass, and attribute columns.

Owns: what counts as a plain value (maps with string keys, lists, str, bytes,
int, float, bool, None; nested at most ``MAX_DEPTH`` deep), the one error a bad
record raises inside the decoder (:class:`BadRecord`), map decoding that refuses
duplicate keys, and how per-value attribute dicts become columns (every value
has the attribute) plus per-key extras, and back.

>>> dense, sparse = split_attrs(["a", "b"], [{"n": 1}, {"n": 2, "x": True}])
>>> dense, sparse
({'n': [1, 2]}, {'b': {'x': True}})
>>> attrs_from_columns(["a", "b"], dense, sparse)
[{'n': 1}, {'n': 2, 'x': True}]
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Set
from itertools import repeat
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "BadRecord",
    "attrs_from_columns",
    "build_attrs",
    "check_attrs",
    "check_plain",
    "row_attrs",
    "split_attrs",
    "types_of",
    "unique_pairs",
]

#: Deepest nesting of maps/arrays accepted in the record, metadata included.
MAX_DEPTH = 64
_SCALAR_TYPES = frozenset({str, int, float, bool, bytes, type(None)})


def types_of(items: list[Any]) -> set[type]:
    return set(map(type, items))


def split_attrs(
    keys: list[str], attrs: list[Mapping[str, Any]]
) -> tuple[dict[str, list[Any]], dict[str, dict[str, Any]]]:
    """Attributes every value has become columns; the others a map from key to extras."""
    if not attrs:
        return {}, {}
    first = tuple(attrs[0])
    common = list(first)
    if not all(tuple(a) == first for a in attrs):
        have = set(first)
        for a in attrs:
            have.intersection_update(a)
        common = [n for n in first if n in have]
    dense = {n: [a[n] for a in attrs] for n in common}
    sparse: dict[str, dict[str, Any]] = {}
    for key, a in zip(keys, attrs, strict=True):
        if len(a) != len(common):
            sparse[key] = {k: v for k, v in a.items() if k not in dense}
    return dense, sparse


def unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise BadRecord(f"duplicate map key {dup!r}")
    return out


class BadRecord(ValueError):
    """A record (or a value in it) that breaks the schema; the decoder names the file."""


def check_plain(obj: Any, where: str, *, max_depth: int = MAX_DEPTH) -> None:
    """Raise ``BadRecord`` unless ``obj`` holds only plain msgpack types (integers in
    msgpack's 64-bit range), nested at most ``max_depth`` deep; the message names the
    place of what is refused (``'a/0'``).

    >>> check_plain({"a": [1, 2**64]}, "the metadata")
    Traceback (most recent call last):
    ...
    ckptvar.storage._plain.BadRecord: the metadata holds the integer 18446744073709551616 at 'a/1', outside the 64-bit range msgpack stores
    """
    # (item, depth, its parent's entry, its key in the parent): the place, kept for the error
    stack: list[tuple[Any, int, Any, Any]] = [(obj, 0, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if depth > max_depth:
            raise BadRecord(f"{where} is nested deeper than {max_depth} levels")
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise BadRecord(f"{where} has a non-string map key {k!r}{_at(entry)}")
                stack.append((v, depth + 1, entry, k))
        elif isinstance(item, list):
            stack.extend((v, depth + 1, entry, i) for i, v in enumerate(item))
        elif isinstance(item, int) and not _INT_MIN <= item <= _UINT_MAX:
            raise BadRecord(f"{where} holds the integer {item}{_at(entry)}, outside the "
                            "64-bit range msgpack stores")
        elif item is None or isinstance(item, bool | int | float | str | bytes):
            continue
        else:
            raise BadRecord(f"{where} holds an unsupported {type(item).__name__}{_at(entry)}")


_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1


def _at(entry: tuple[Any, int, Any, Any]) -> str:
    """`` at 'a/0'``: the place of a :func:`check_plain` stack entry (nothing at the top)."""
    keys = []
    while entry[2] is not None:
        keys.append(str(entry[3]))
        entry = entry[2]
    return f" at {'/'.join(reversed(keys))!r}" if keys else ""


def attrs_from_columns(keys: list[str], dense: Any, sparse: Any) -> list[dict[str, Any]]:
    """Each value's attribute dict, from the columns and the per-key extras."""
    check_attrs(keys, dense, sparse)
    return build_attrs(keys, dense, sparse)


def check_attrs(keys: list[str], dense: Any, sparse: Any,
                index: Mapping[str, int] | None = None) -> None:
    """Raise ``BadRecord`` unless ``dense`` is a map of attribute columns of one item per
    key and ``sparse`` a map of stored keys to extra attributes (plain, none repeating a
    column); ``index`` is ``{key: position}`` if the caller has it."""
    n = len(keys)
    if not isinstance(dense, dict):
        raise BadRecord("'attrs' is not a map of attribute columns")
    for name, col in dense.items():
        if not isinstance(col, list) or len(col) != n:
            raise BadRecord(f"the attribute column {name!r} is not a list of {n} items")
        if not types_of(col) <= _SCALAR_TYPES:
            check_plain(col, f"the attribute column {name!r}", max_depth=MAX_DEPTH - 2)
    if not isinstance(sparse, dict):
        raise BadRecord("'sparse_attrs' is not a map")
    if sparse:
        _check_sparse(sparse, index if index is not None else set(keys), dense.keys())


def _check_sparse(sparse: dict[Any, Any], known: Container[str], names: Set[str]) -> None:
    """Each key's extra attributes: a stored key, a plain map, no column repeated."""
    for key, extra in sparse.items():
        if key not in known:
            raise BadRecord(f"'sparse_attrs' names {key!r}, which is not a stored key")
        if not isinstance(extra, dict):
            raise BadRecord(f"{key!r} has attrs that are not a map")
        check_plain(extra, f"the attrs of {key!r}", max_depth=MAX_DEPTH - 2)
        clash = set(extra) & names
        if clash:
            raise BadRecord(f"{key!r} repeats the attribute {sorted(clash)[0]!r}")


def build_attrs(keys: list[str], dense: dict[str, list[Any]],
                sparse: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each value's attribute dict from columns and extras that :func:`check_attrs` passed."""
    n = len(keys)
    names = list(dense)
    if len(names) == 1:
        (only,) = names
        out = [{only: v} for v in dense[only]]
    elif names:  # every column has n items (checked): one dict per row, made in C
        out = list(map(dict, map(zip, repeat(names), zip(*dense.values(), strict=True))))
    else:
        out = [{} for _ in range(n)]
    if sparse:
        index = {k: i for i, k in enumerate(keys)}
        for key, extra in sparse.items():
            out[index[key]].update(extra)
    return out


def row_attrs(key: str, i: int, dense: dict[str, list[Any]],
              sparse: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The attribute dict of one value, the ``i``-th, from checked columns and extras."""
    out = {name: col[i] for name, col in dense.items()}
    extra = sparse.get(key)
    if extra:
        out.update(extra)
    return out
