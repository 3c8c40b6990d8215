"""``ckpt gc``: remove what dead saves left in a checkpoint directory or at a URL."""

from __future__ import annotations

import argparse
from typing import TextIO

import ckptvar as cv

from ._common import EXIT_OK, storage_options
from ._output import dump_json, escape
from .ls import held_steps

EPILOG = """\
Removes what saves that died (killed, preempted, out of disk) left behind:
temporaries beside the final names (while nothing saves into the directory: no
manager, no Checkpoint.save, cv.save or ckpt convert of this host), this host's
staging directories in TMPDIR whose process is gone, and at an
object-store URL the claims of dead writers and objects below steps no save can
commit any more. A save in flight and every committed checkpoint are left alone.
A CheckpointManager's next save does the same. Incomplete multipart uploads
cannot be listed by the client: see docs/cloud.md for the bucket lifecycle rule.

--json prints one object: {"path", "dry_run", "removed": [{"path", "what",
"bytes"}, ...] (with --dry-run: what would be removed), "bytes_freed", "kept":
[{"path", "referred_by"}, ...]} ("kept": steps left because later incremental steps
refer to their bytes).

exit status: 0 done (or nothing to do), 2 missing or unreadable input.

examples:
  ckpt gc runs/
  ckpt gc s3://bucket/run --dry-run
  ckpt gc runs/ --dry-run --json
"""

HELP = "remove what dead saves left (temporaries, staging files, claims, uncommitted objects)"
DESCRIPTION = "Remove what dead saves left in a checkpoint directory or at a URL."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt gc``."""
    p.add_argument("path", metavar="DIR|URL", help="the checkpoint directory or URL")
    p.add_argument("--dry-run", action="store_true",
                   help="only list what would be removed")
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def run(args: argparse.Namespace, out: TextIO) -> int:
    found = cv.checkpoint.gc(args.path, dry_run=args.dry_run,
                             storage_options=storage_options())
    total = sum(left.nbytes for left in found)
    if args.json:
        dump_json({"path": args.path, "dry_run": args.dry_run,
                   "removed": [{"path": left.path, "what": left.what, "bytes": left.nbytes}
                               for left in found],
                   "bytes_freed": total, "kept": held_steps(args.path)}, out)
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for left in found:
        print(f"{verb}  {left.what}  {escape(left.path)}  {left.nbytes} bytes", file=out)
    print(f"{verb} {len(found)} leftover{'s' if len(found) != 1 else ''}, "
          f"{total} bytes ({_size(total)})", file=out)
    return EXIT_OK
