"""Fuzz harnesses, one per parser ckptvar owns (atheris, opt-in).

Targets (``python tests/fuzz/fuzz_targets.py TARGET [libFuzzer options]``):

========== ============================================ ==========================
target     parser                                       seeds
========== ============================================ ==========================
record     ckptvar root record (strict msgpack schema)  records of saved checkpoints
h5         a whole ckptvar ``.h5`` file (user block,    small saved checkpoints
           record, value regions, checksums)
safetensors safetensors header and data                 fixtures/safetensors
npz        ``.npz`` zip + ``.npy`` headers               fixtures/npz
torch      ``.pt`` zip and legacy pickles (restricted   fixtures/torch
           unpickler)
tf_index   TensorBundle ``.index`` (SSTable, protobuf)  fixtures/tf1_saver
========== ============================================ ==========================

Each input is handed to the parser as a file (or bytes for ``record``). The only
allowed outcomes are a ``CkptError`` or a successful load of NumPy arrays; for
the checksummed native formats a successful load must equal one of the seeds'
values exactly. Anything else (another exception, a crash, a hang or an
allocation over libFuzzer's ``-rss_limit_mb``) is a finding.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

import ckptvar as cv
from ckptvar.storage import _record

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
_TMP = Path(tempfile.mkdtemp(prefix="ckptvar-fuzz-"))
atexit.register(shutil.rmtree, _TMP, True)


def _native_values() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {"w": rng.standard_normal((20, 30)).astype(np.float32), "b": np.arange(3),
         "s": np.array(7, np.int64)},
        {"big": rng.standard_normal(17000).astype(np.float32), "e": np.zeros((0, 2))},
    ]


def _native_seeds(fmt: str) -> list[bytes]:
    out = []
    for i, vals in enumerate(_native_values()):
        p = cv.save(_TMP / f"seed{i}.{fmt}", vals, metadata={"i": i})
        out.append(Path(p).read_bytes())
    return out


def _record_seeds() -> list[bytes]:
    from ckptvar.storage._h5 import read_userblock

    out = []
    for data in _native_seeds("h5"):
        p = _TMP / "rec.h5"
        p.write_bytes(data)
        fd = os.open(p, os.O_RDONLY)
        try:
            _, _, off, n, _ = read_userblock(fd, p)
        finally:
            os.close(fd)
        out.append(data[off: off + n])
    return out


def _fixture_seeds(*rel: str) -> list[bytes]:
    return [(FIXTURES / r).read_bytes() for r in rel if (FIXTURES / r).exists()]


def _check_arrays(got: dict[str, object]) -> None:
    for k, v in got.items():
        assert isinstance(k, str)
        assert isinstance(v, np.ndarray), type(v)


def _same_as_a_seed(got: dict[str, np.ndarray]) -> None:
    for vals in _native_values():
        if set(got) == set(vals) and all(
            got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes()
            for k, v in vals.items()
        ):
            return
    raise AssertionError("a damaged native checkpoint loaded with values no seed has")


def _load_file(data: bytes, name: str) -> dict[str, np.ndarray]:
    p = _TMP / name
    p.write_bytes(data)
    with warnings.catch_warnings():  # values that are not numbers, listed and left out: fine
        warnings.filterwarnings("ignore", message=r"cv\.load\(.*\) leaves out")
        return cv.load(p)


def one_record(data: bytes) -> None:
    try:
        rec = _record.decode(data, "fuzz-input", container="h5", file_size=1 << 20)
    except cv.CkptError:
        return
    assert isinstance(rec.values, Mapping)


def one_h5(data: bytes) -> None:
    try:
        got = _load_file(data, "input.h5")
    except cv.CkptError:
        return
    _same_as_a_seed(got)


def one_safetensors(data: bytes) -> None:
    try:
        _check_arrays(_load_file(data, "input.safetensors"))
    except cv.CkptError:
        return


def one_npz(data: bytes) -> None:
    try:
        _check_arrays(_load_file(data, "input.npz"))
    except cv.CkptError:
        return


def one_torch(data: bytes) -> None:
    try:
        _check_arrays(_load_file(data, "input.pt"))
    except cv.CkptError:
        return


_TF_DATA = FIXTURES / "tf1_saver" / "model.ckpt.data-00000-of-00001"


def one_tf_index(data: bytes) -> None:
    prefix = _TMP / "tf" / "model.ckpt"
    prefix.parent.mkdir(exist_ok=True)
    data_file = Path(str(prefix) + ".data-00000-of-00001")
    if not data_file.exists() and _TF_DATA.exists():
        data_file.write_bytes(_TF_DATA.read_bytes())
    Path(str(prefix) + ".index").write_bytes(data)
    try:
        _check_arrays(cv.load(prefix))
    except cv.CkptError:
        return


TARGETS: dict[str, tuple[Callable[[], list[bytes]], Callable[[bytes], None]]] = {
    "record": (_record_seeds, one_record),
    "h5": (lambda: _native_seeds("h5"), one_h5),
    "safetensors": (lambda: _fixture_seeds("safetensors/model.safetensors"), one_safetensors),
    "npz": (lambda: _fixture_seeds("npz/plain.npz", "npz/compressed.npz"), one_npz),
    "torch": (lambda: _fixture_seeds("torch/state_dict.pt", "torch/legacy.bin",
                                     "torch/nested.pth"), one_torch),
    "tf_index": (lambda: _fixture_seeds("tf1_saver/model.ckpt.index"), one_tf_index),
}


def main(argv: list[str]) -> None:
    """``fuzz_targets.py TARGET [libFuzzer flags]``: fuzz one target from its seeds."""
    import atheris  # noqa: PLC0415 - optional, fuzzing only

    name, rest = argv[1], argv[2:]
    seeds_fn, one = TARGETS[name]
    corpus = _TMP / f"corpus-{name}"
    corpus.mkdir(exist_ok=True)
    for i, seed in enumerate(seeds_fn()):
        (corpus / f"seed{i}").write_bytes(seed)

    def test_one_input(data: bytes) -> None:
        one(data)

    atheris.Setup([argv[0], *rest, str(corpus)], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
