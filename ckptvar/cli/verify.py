"""``ckpt verify``: every value of a checkpoint checked against its stored checksum."""

from __future__ import annotations

import argparse
import threading
from typing import TextIO

import ckptvar as cv

from ._common import (
    EXIT_MISMATCH,
    EXIT_OK,
    add_selection,
    latest_or_path,
    open_checkpoint,
    progress_for,
    select,
    selected,
)
from ._output import dump_json, escape, one_line
from ._progress import Progress

EPILOG = """\
Reads every value and checks it against its stored checksum. Formats without
checksums (.safetensors, PyTorch DCP, Orbax) are read and checked for structure,
and the result says "READABLE ... not checksummed" instead of "OK".
Every damaged value is named, a truncated file included; a value the reader
cannot read as numbers (an object array, a string tensor) is listed as SKIPPED
and counted in the verdict, never called verified. --filter/--exclude
(globs, repeatable) verify only some keys; a selection matching nothing is an
error (exit 2). --json prints {"path", "format", "status", "values", "unchecked",
"damaged": [{"key", "reason"}, ...], "skipped": [{"key", "reason"}, ...]} (status:
ok, readable where nothing is checksummed, or damaged), with the same exit status.

exit status: 0 all values intact (or readable, where not checksummed), 1 damage found, 2 missing or unreadable input (an object store that does not answer included: never called damage).

examples:
  ckpt verify runs/ckpt-3.h5
  ckpt verify runs/ --json
  ckpt verify model.pt --filter 'encoder.*' --exclude '*.num_batches_tracked'
"""


HELP = "check every value against its checksum"
DESCRIPTION = "Check every value of a checkpoint against its stored checksum."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt verify``."""
    p.add_argument(
        "path", metavar="PATH",
        help="the checkpoint to verify, or a manager's directory (its latest checkpoint)",
    )
    add_selection(p)
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def _info(reader: cv.storage.Reader, key: str) -> cv.storage.ArrayInfo | None:
    """``reader.info(key)``, or None when what describes it (a shard's header) is damaged."""
    try:
        return reader.info(key)
    except (cv.CorruptCheckpointError, OSError) as exc:
        if _unreached(exc):
            raise
        return None


def _unreached(exc: BaseException) -> bool:
    """Whether a failed read says nothing of the bytes: the store did not answer (ckptvar's
    ``OSError``, a timeout among them), unlike damage or a missing file. It ends the
    command as an error (exit 2), never as damage."""
    return (isinstance(exc, cv.CkptError) and isinstance(exc, OSError)
            and not isinstance(exc, FileNotFoundError))


def run(args: argparse.Namespace, out: TextIO) -> int:
    path = str(args.path)
    try:  # a manager's directory's latest step is opened to be found: damage there too
        path = str(latest_or_path(args.path))
        reader = open_checkpoint(path)
    except cv.CorruptCheckpointError as exc:
        if args.json:  # as for a value: the file is named in place of a key
            return _report_json(path, None, (0, 0, 0), [(path, one_line(exc))], out)
        print(f"DAMAGED  {escape(path)}: {one_line(exc)}", file=out)
        print(f"FAILED: {escape(path)} cannot be read", file=out)
        return EXIT_MISMATCH
    with reader:
        damaged: list[tuple[str, str]] = []
        keys = select(reader, args, where=repr(str(path)))
        partial = len(keys) != len(reader)
        try:
            reader.metadata()
        except cv.CorruptCheckpointError as exc:
            damaged.append(("<metadata>", one_line(exc)))
        infos = {k: _info(reader, k) for k in keys}  # None: a damaged header, reported below
        bar = progress_for(sum(i.nbytes for i in infos.values() if i is not None), args)
        bulk = isinstance(reader, cv.storage.SupportsVerifyAll)
        if bulk and not partial and not bar.enabled:
            try:
                damaged += [(str(k), str(reason)) for k, reason in reader.verify_all()]
            except (cv.CorruptCheckpointError, OSError) as exc:  # damage beyond one value
                if _unreached(exc):
                    raise
                damaged.append(("<checkpoint>", one_line(exc)))
        else:
            with bar:
                for key in keys:
                    info = infos[key]
                    try:
                        _verify(reader, key, info.nbytes if info is not None else 0, bar)
                    except (cv.CorruptCheckpointError, OSError) as exc:
                        if _unreached(exc):
                            raise
                        damaged.append((key, one_line(exc)))
        unchecked = sum(1 for i in infos.values() if i is not None and not i.checked)
        fmt = reader.format
        skipped = {k: v for k, v in reader.skipped.items() if selected(k, args)}
    return _verdict(args, path, fmt, (len(keys), unchecked), damaged, out=out, skipped=skipped)


def _verdict(args: argparse.Namespace, path: str, fmt: str, counts: tuple[int, int],
             damaged: list[tuple[str, str]], *, out: TextIO, skipped: dict[str, str]) -> int:
    """Report the verdict (``--json``: one object), the values never read said too."""
    n, unchecked = counts
    if args.json:
        return _report_json(path, fmt, (n, unchecked, len(skipped)), damaged, out,
                            skipped=skipped)
    for key, reason in sorted(skipped.items()):  # never read, so never verified: said
        print(f"SKIPPED  {escape(key)}: {escape(one_line(reason))}", file=out)
    return _report(path, fmt, (n, unchecked, len(skipped)), damaged, out)


#: A value of more than this many bytes moves the bar while it is verified.
WATCHED_BYTES = 64 << 20


def _verify(reader: cv.storage.Reader, key: str, nbytes: int, bar: Progress) -> None:
    """``reader.verify(key)``, the bar counting ``nbytes`` for it.

    A large value is verified on a thread of its own while the bar follows the bytes the
    process reads (``rchar`` of ``/proc/self/io``, at most the value's size): a
    multi-gigabyte value moves the bar as it is read, rather than leaving it still
    for the minutes its check takes (where that count is unknown, the bar moves at the end).
    """
    if not bar.enabled or nbytes <= WATCHED_BYTES or _bytes_read() is None:
        reader.verify(key)
        bar.update(nbytes, key)
        return
    failed: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            reader.verify(key)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the command's thread
            failed.append(exc)
        finally:
            done.set()

    base, counted = _bytes_read() or 0, 0
    threading.Thread(target=work, name="ckpt-verify", daemon=True).start()
    while not done.wait(0.1):
        now = min((_bytes_read() or 0) - base, nbytes - 1)
        if now > counted:
            bar.update(now - counted, key, values=0)
            counted = now
    if failed:
        raise failed[0]
    bar.update(nbytes - counted, key)


def _bytes_read() -> int | None:
    """The bytes this process has read by system calls (``rchar``), or None."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _report_json(
    path: str, fmt: str | None, counts: tuple[int, int, int], damaged: list[tuple[str, str]],
    out: TextIO, *, skipped: dict[str, str] | None = None,
) -> int:
    """The verdict as one JSON object (``status``: ok, readable or damaged)."""
    n, unchecked, _ = counts
    status = "damaged" if damaged else ("readable" if n and unchecked == n else "ok")
    dump_json({"path": path, "format": fmt, "status": status, "values": n,
               "unchecked": unchecked,
               "damaged": [{"key": k, "reason": one_line(r)} for k, r in damaged],
               "skipped": [{"key": k, "reason": one_line(r)}
                           for k, r in sorted((skipped or {}).items())]}, out)
    return EXIT_MISMATCH if damaged else EXIT_OK


def _report(
    path: str, fmt: str | None, counts: tuple[int, int, int], damaged: list[tuple[str, str]],
    out: TextIO,
) -> int:
    """Print the verdict: each damaged value, or READABLE (nothing checksummed), or OK.

    ``counts`` is (values checked, values without a stored checksum, values skipped:
    the reader cannot read them as numbers, so nothing of them was verified)."""
    n, unchecked, skipped = counts
    also = f"; {skipped} skipped (not read, so not verified)" if skipped else ""
    if damaged:
        for key, reason in damaged:
            print(f"DAMAGED  {escape(key)}: {escape(one_line(reason))}", file=out)
        print(f"FAILED: {len(damaged)} of {n} values damaged in {escape(path)}{also}", file=out)
        return EXIT_MISMATCH
    if n and unchecked == n:
        print(
            f"READABLE: {n} value{'s' if n != 1 else ''} read and checked for structure; not "
            f"checksummed ({escape(fmt)} stores no checksums to verify them against){also}",
            file=out,
        )
        return EXIT_OK
    note = ""
    if unchecked:
        note = f" ({unchecked} without a stored checksum: read and checked for structure only)"
    print(f"OK: {n} value{'s' if n != 1 else ''} verified{note}{also}", file=out)
    return EXIT_OK
