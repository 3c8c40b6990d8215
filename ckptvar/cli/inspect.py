"""``ckpt inspect``: a checkpoint's values as a table, a tree or JSON, optionally with statistics."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import ckptvar as cv

from ._blocks import Stats, value_blocks
from ._common import (
    EXIT_OK,
    add_selection,
    open_checkpoint,
    progress_for,
    resolve_latest,
    select,
    selected,
)
from ._lazy import lazy_module
from ._output import (
    dtype_str,
    dump_json,
    escape,
    natural_key,
    num,
    plain,
    shape_str,
    summary,
    table,
)
from ._progress import human_size

if TYPE_CHECKING:
    import numpy as np
else:  # loaded on first use: `ckpt --help` imports no NumPy
    np = lazy_module("numpy")

EPILOG = """\
PATH may be a ckptvar checkpoint (.h5, .zarr) or a foreign one: a TensorFlow
checkpoint prefix (ckpt-1 for ckpt-1.index), PyTorch .pt/.pth/.bin,
.safetensors, Keras .weights.h5 or .npz. Nothing is executed while reading.

--stats reads every value in blocks of about a million elements, so memory
stays small whatever the size; min/max/mean/std cover the finite elements only
(complex values: their magnitude) and NaN/Inf are counted.

Keys are listed in natural order (vars/2 before vars/10) unless --order stored.
A Keras file's own layer names (its keys are HDF5 paths such as
layers/dense/vars/0) appear in a LAYER column and in the tree.
Values a reader cannot read as numbers (string or compound HDF5 datasets, TF
string tensors) are listed as skipped, with the reason. --filter and --exclude
take globs, repeatable (the union of the filters, minus the excludes); a
selection that matches nothing is an error (exit 2). A manager's directory
stands for its latest checkpoint (the output says so).

--json prints one object: {"path", "format", "metadata", "variables": [{"key",
"name", "dtype", "shape", "nbytes", "trainable", "attrs"}, ...], "skipped":
[{"key", "reason"}, ...]} ("latest_of" names the directory when PATH was one);
--stats adds "min", "max", "mean", "std", "nan", "inf" (null where there is no
finite element). An incremental step adds "shared": {key: [steps]}, the steps
that hold (HDF5) or share (Zarr hard links) each value's bytes, also listed
below the table; a row delta adds "deltas": {key: {"base", "patches", "rows"}}
(the step that wrote its whole copy, its row patches and their rows).

examples:
  ckpt inspect runs/ckpt-3.h5
  ckpt inspect runs/                      # the latest checkpoint in runs/
  ckpt inspect runs/ckpt-3.h5 --tree
  ckpt inspect tf_ckpt/ckpt-1 --filter 'model/*/kernel' --filter 'model/*/bias' --stats
  ckpt inspect model.safetensors --exclude '*.bias' --order stored
  ckpt inspect model.safetensors --json | python -m json.tool
"""


HELP = "list the values of a checkpoint"
DESCRIPTION = "List a checkpoint's values: key, dtype, shape, size, trainable."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt inspect``."""
    p.add_argument(
        "path",
        metavar="PATH",
        help="the checkpoint (file, .zarr directory or TF prefix), or a manager's "
        "directory (its latest checkpoint)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    p.add_argument("--stats", action="store_true", help="add min/max/mean/std and NaN/Inf counts")
    p.add_argument("--tree", action="store_true", help="show the keys as the object-graph tree")
    p.add_argument(
        "--boxes",
        action="store_true",
        help="list the stored boxes (offset, shape) of each value of a checkpoint written by "
        "many processes (the table's BOXES column counts them)",
    )
    add_selection(p)
    p.add_argument(
        "--order",
        choices=("natural", "stored"),
        default="natural",
        help="list keys in natural order (vars/2 before vars/10; the default) or as stored",
    )


def _record(reader: Any, key: str, *, with_attrs: bool = False) -> dict[str, Any]:
    info = reader.info(key)
    attrs = dict(info.attrs or {})
    trainable = attrs.get("trainable")
    rec = {
        "key": key,
        "name": str(attrs.get("name", key)),
        "dtype": dtype_str(info.dtype),
        "shape": [int(d) for d in info.shape],
        "nbytes": int(info.nbytes),
        "trainable": bool(trainable) if isinstance(trainable, (bool, np.bool_)) else None,
    }
    if with_attrs:
        rec["attrs"] = attrs
    elif "layer" in attrs and str(attrs["layer"]) not in key.split("/"):
        rec["layer"] = str(attrs["layer"])  # a Keras 3 layer's own name, which its key lacks
    return rec


def _tree_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The keys as a tree of their segments, leaves annotated with dtype/shape/size.

    Segments are split at ``/`` (object-graph keys); PyTorch-style keys with no ``/``
    at all (``model.layers.0.weight``) are split at ``.`` instead.
    """
    keys = [rec["key"] for rec in records]
    sep = "." if not any("/" in k for k in keys) and any("." in k for k in keys) else "/"
    root: dict[str, Any] = {}
    leaves: dict[int, dict[str, Any]] = {}
    for rec in records:
        node = root
        parts = rec["key"].split(sep)
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # a key that is also a prefix of another key
                child = node[part + sep] = {}
            node = child
        node[parts[-1] if parts[-1] not in node else parts[-1] + " "] = id(rec)
        leaves[id(rec)] = rec

    lines: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        items = list(node.items())
        for i, (name, child) in enumerate(items):
            last = i == len(items) - 1
            branch = "└── " if last else "├── "
            if isinstance(child, dict):
                lines.append(prefix + branch + escape(name))
                walk(child, prefix + ("    " if last else "│   "))
            else:
                rec = leaves[child]
                detail = f"{rec['dtype']} {shape_str(rec['shape'])} {human_size(rec['nbytes'])}"
                if rec["trainable"] is False:
                    detail += ", not trainable"
                if rec["name"] != rec["key"] and rec["name"] != name:
                    detail += f", name {escape(repr(rec['name']))}"
                if "layer" in rec:
                    detail += f", layer {escape(repr(rec['layer']))}"
                lines.append(f"{prefix}{branch}{escape(name)}  [{detail}]")

    walk(root, "")
    return lines


#: ckptvar's own formats, whose values are variables; any other file holds "values".
_OWN_FORMATS = frozenset({"h5", "zarr"})


def _add_stats(reader: Any, records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Add min/max/mean/std/nan/inf to each record, reading values block by block."""
    total = sum(r["nbytes"] for r in records)
    with progress_for(total, args) as bar:
        for rec in records:
            stats = Stats()
            key = rec["key"]
            for _, block in value_blocks(reader, key, reader.info(key), bar.bytes_of(key)):
                stats.add(block)
            bar.update(0, key)
            rec.update(stats.as_dict())


def run(args: argparse.Namespace, out: TextIO) -> int:
    path, note = resolve_latest(args.path)
    with open_checkpoint(path) as reader:
        skipped = {k: v for k, v in reader.skipped.items() if selected(k, args)}
        keys = select(reader, args, where=repr(str(path)), allow_empty=bool(skipped))
        if args.order == "natural":
            keys.sort(key=natural_key)
            skipped = {k: skipped[k] for k in sorted(skipped, key=natural_key)}
        records = [_record(reader, k, with_attrs=args.json) for k in keys]
        if args.stats:
            _add_stats(reader, records, args)
        fmt = str(reader.format)
        metadata = reader.metadata()
        shared = _shared(reader, keys)
        deltas = _deltas(reader, keys)
        _add_boxes(reader, records)

    if args.json:
        doc: dict[str, Any] = {"path": str(path)}
        if note:
            doc["latest_of"] = str(args.path)
        doc.update(
            format=fmt,
            metadata=plain(metadata),
            variables=plain(records),
            skipped=[{"key": k, "reason": v} for k, v in skipped.items()],
        )
        doc.update({k: v for k, v in (("shared", shared), ("deltas", deltas)) if v})
        dump_json(doc, out)
        return EXIT_OK

    if note:
        print(f"(inspecting {escape(note)})", file=out)
    print(f"path: {escape(path)}", file=out)
    print(f"format: {escape(fmt)}", file=out)
    if metadata:
        print("metadata:", file=out)
        for mkey, mval in metadata.items():
            print(f"  {escape(mkey)}: {summary(mval)}", file=out)
    print(file=out)
    noun = "variable" if fmt in _OWN_FORMATS else "value"
    _print_values(records, skipped, noun, args, out)
    _print_shared(shared, noun, out)
    _print_deltas(deltas, noun, out)
    if args.boxes:
        _print_boxes(records, out)
    return EXIT_OK


def _add_boxes(reader: Any, records: list[dict[str, Any]]) -> None:
    """Each record's stored boxes, for a reader of the multi-process layout."""
    if not isinstance(reader, cv.storage.SupportsStoredBoxes):
        return
    for rec in records:
        rec["boxes"] = [{"offset": [int(o) for o in b.offset], "shape": [int(d) for d in b.shape]}
                        for b in reader.stored_boxes(rec["key"])]


def _print_boxes(records: list[dict[str, Any]], out: TextIO) -> None:
    """Each value's stored boxes (a checkpoint of many processes), or why there are none."""
    if not any("boxes" in r for r in records):
        print("\nboxes: none (each value is stored whole; boxes are the layout of a "
              "checkpoint written by many processes)", file=out)
        return
    print("\nstored boxes (offset, shape):", file=out)
    for rec in records:
        boxes = rec.get("boxes", [])
        print(f"  {escape(rec['key'])}: {len(boxes)} box{'es' if len(boxes) != 1 else ''}",
              file=out)
        for b in boxes:
            print(f"    at {shape_str(b['offset'])} shape {shape_str(b['shape'])}", file=out)


def _shared(reader: Any, keys: list[str]) -> dict[str, list[str]]:
    """Of ``keys``, those whose bytes other steps hold or share (an incremental step)."""
    if not isinstance(reader, cv.storage.SupportsShared):
        return {}
    shared = reader.shared()
    return {k: shared[k] for k in keys if k in shared}


def _deltas(reader: Any, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Of ``keys``, those stored as row deltas (format 1.5)."""
    if not isinstance(reader, cv.storage.SupportsDeltas):
        return {}
    deltas = reader.deltas()
    return {k: deltas[k] for k in keys if k in deltas}


def _print_deltas(deltas: dict[str, dict[str, Any]], noun: str, out: TextIO) -> None:
    if not deltas:
        return
    print(f"\nrow deltas: {len(deltas)} {noun}(s) stored as a base plus changed rows",
          file=out)
    for line in table([[escape(k), f"base in {escape(d['base'])}",
                        f"{d['patches']} patch(es), {d['rows']} row(s)"
                        + (f" in {d['boxes']} box(es)" if "boxes" in d else "")]
                       for k, d in deltas.items()]):
        print("  " + line, file=out)


def _print_shared(shared: dict[str, list[str]], noun: str, out: TextIO) -> None:
    if not shared:
        return
    print(f"\nshared with other steps (incremental): {len(shared)} {noun}(s), "
          "the bytes in", file=out)
    for line in table([[escape(k), ", ".join(escape(n) for n in names) or "-"]
                       for k, names in shared.items()]):
        print("  " + line, file=out)


def _print_values(
    records: list[dict[str, Any]],
    skipped: dict[str, str],
    noun: str,
    args: argparse.Namespace,
    out: TextIO,
) -> None:
    """The table (or tree) of values, the skipped ones, and the totals line."""
    if args.tree:
        for line in _tree_lines(records):
            print(line, file=out)
    else:
        layers = any("layer" in r for r in records)
        for line in table(_rows(records, args.stats), _right(args.stats, layers)):
            print(line, file=out)
        if not records:
            print(f"(no {noun}s)", file=out)
    if skipped:
        print(f"\nskipped (cannot be read as numbers): {len(skipped)}", file=out)
        for line in table([[escape(k), escape(v)] for k, v in skipped.items()]):
            print("  " + line, file=out)
    n = len(records)
    elements = sum(math.prod(r["shape"]) for r in records)
    total = sum(r["nbytes"] for r in records)
    trainable = sum(math.prod(r["shape"]) for r in records if r["trainable"])
    line = (
        f"\n{n} {noun}{'s' if n != 1 else ''}, {elements:,} element"
        f"{'s' if elements != 1 else ''}, {human_size(total)}"
    )
    if any(r["trainable"] is not None for r in records):
        line += f" ({trainable:,} trainable elements)"
    if skipped:
        line += f"; {len(skipped)} skipped"
    print(line, file=out)


def _right(stats: bool, layers: bool = False) -> frozenset[int]:
    shift = 1 if layers else 0
    return frozenset({3 + shift} | (set(range(5 + shift, 11 + shift)) if stats else set()))


def _rows(records: Sequence[dict[str, Any]], stats: bool) -> list[list[str]]:
    layers = any("layer" in r for r in records)
    header = ["KEY", *(["LAYER"] if layers else []), "DTYPE", "SHAPE", "SIZE", "TRAINABLE"]
    if stats:
        header += ["MIN", "MAX", "MEAN", "STD", "NAN", "INF"]
    boxed = any("boxes" in r for r in records)  # a checkpoint of many processes
    if boxed:
        header.append("BOXES")
    rows = [header]
    for rec in records:
        tr = rec["trainable"]
        row = [
            escape(rec["key"]),
            *([escape(rec.get("layer", "-"))] if layers else []),
            rec["dtype"],
            shape_str(rec["shape"]),
            human_size(rec["nbytes"]),
            "-" if tr is None else ("yes" if tr else "no"),
        ]
        if stats:
            row += [num(rec[f]) for f in ("min", "max", "mean", "std", "nan", "inf")]
        if boxed:
            row.append(str(len(rec.get("boxes", ()))))
        rows.append(row)
    return rows
