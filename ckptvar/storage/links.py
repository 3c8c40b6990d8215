"""What a checkpoint may refer to through a symbolic link: only what stays inside it.

Owns :func:`inside`, the one home of the rule "nothing outside a checkpoint is read":
a file of a checkpoint directory is read through a symbolic link only when the link's
target is still inside that directory; a link out of it is a
``CorruptCheckpointError`` naming the link and its target.

>>> import tempfile
>>> from pathlib import Path
>>> top = Path(tempfile.mkdtemp())
>>> (top / "step").mkdir(); (top / "step" / "real").write_text("x")
1
>>> (top / "step" / "same").symlink_to("real")
>>> inside(top / "step", top / "step" / "same", "The file") == top / "step" / "same"
True
>>> (top / "step" / "out").symlink_to(top)
>>> inside(top / "step", top / "step" / "out", "The file")  # doctest: +ELLIPSIS
Traceback (most recent call last):
ckptvar.errors.CorruptCheckpointError: The file '.../out' is a symbolic link to '...', ...
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CorruptCheckpointError

__all__ = ["inside"]


def inside(root: Path, path: Path, what: str, *, hub: bool = False) -> Path:
    """``path``, a file of the checkpoint directory ``root``, when it is still inside
    ``root`` once its symbolic links are followed; a link leading out of it is refused,
    naming the link and its target (nothing outside a checkpoint is read).

    ``hub``: also take a link into a Hugging Face hub cache's blobs,
    ``models--<org>--<name>/blobs/<blob>``: the hub keeps every downloaded file there, a
    snapshot's files (and a ``local_dir`` download's, with older ``huggingface_hub``)
    being links to them.
    """
    top = root.resolve()

    def stays(real: Path) -> bool:
        return real == top or top in real.parents or (
            hub and real.parent.name == "blobs"
            and real.parent.parent.name.startswith(("models--", "datasets--", "spaces--")))

    if stays(path.resolve()):
        return path
    link = root
    for part in path.relative_to(root).parts:  # the first link that leads out
        link = link / part
        if link.is_symlink() and not stays(link.resolve()):
            break
    raise CorruptCheckpointError(
        f"{what} {str(link)!r} is a symbolic link to {str(link.resolve())!r}, outside the "
        f"checkpoint {str(root)!r}; refused (ckptvar reads nothing outside a checkpoint)."
    )
