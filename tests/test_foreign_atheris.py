"""Opt-in coverage-guided fuzzing (atheris) of every foreign parser: ``pytest -m fuzz``.

Each harness writes the fuzzer's bytes as a file of one format (seeded from the
real fixtures) and reads every value; the only allowed outcomes are a load or a
``CkptError``. Run one harness longer by hand::

    python tests/test_foreign_atheris.py torch -runs=200000
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
#: harness name -> (seed file, name of the file the bytes become, sidecars copied beside it)
HARNESSES = {
    "safetensors": ("safetensors/model.safetensors", "x.safetensors", ()),
    "npz": ("npz/compressed.npz", "x.npz", ()),
    "torch": ("torch/state_dict.pt", "x.pt", ()),
    "torch_legacy": ("torch/legacy.bin", "x.bin", ()),
    "tf_index": ("tf1_saver/model.ckpt.index", "m.index", ("model.ckpt.data-00000-of-00001",)),
}


def _harness(name: str) -> None:
    import atheris

    with atheris.instrument_imports():
        import ckptvar as cv
        import ckptvar.storage.foreign  # noqa: F401

    seed, target, sidecars = HARNESSES[name]
    work = Path(tempfile.mkdtemp())
    for side in sidecars:
        (work / side.replace("model.ckpt", "m")).write_bytes(
            (FIXTURES / Path(seed).parent / side).read_bytes()
        )
    path = work / target

    def one(data: bytes) -> None:
        path.write_bytes(data)
        try:
            with cv.open(path.with_suffix("") if name == "tf_index" else path) as reader:
                for key in reader:
                    reader[key].read()
        except cv.CkptError:
            pass

    corpus = work / "corpus"
    corpus.mkdir()
    (corpus / "seed").write_bytes((FIXTURES / seed).read_bytes())
    atheris.Setup([sys.argv[0], *sys.argv[2:], str(corpus)], one)
    atheris.Fuzz()


@pytest.mark.fuzz
@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_atheris_harness(name: str) -> None:
    pytest.importorskip("atheris")
    proc = subprocess.run(
        [sys.executable, __file__, name, "-runs=3000", "-max_total_time=60"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    _harness(sys.argv[1])
