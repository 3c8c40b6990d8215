"""Bounded byte-mutation fuzzing of the foreign parsers on the real fixtures.

Allowed outcomes: a ``CkptError``, or a load of NumPy arrays — identical to the
original for TensorFlow (its index blocks and every value carry a CRC32C). The
other formats carry no checksums of their own, so a flipped byte in a name or a
value can change what is read; the property there is that the reader never
fails with anything but a ``CkptError`` and never hangs or over-allocates.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptvar as cv
from ckptvar.errors import CkptError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CASES = {
    "safetensors": ("safetensors/model.safetensors", None),
    "npz_plain": ("npz/plain.npz", None),
    "npz_compressed": ("npz/compressed.npz", None),
    "torch_zip": ("torch/state_dict.pt", None),
    "torch_legacy": ("torch/legacy.bin", None),
    "tf_index": ("tf1_saver/model.ckpt", "model.ckpt.index"),
    "tf_data": ("tf2_object/ckpt-1", "ckpt-1.data-00000-of-00001"),
    # directory checkpoints: (the directory, the file in it that is damaged)
    "dcp_metadata": ("dcp/two_ranks", ".metadata"),
    "dcp_data": ("dcp/two_ranks", "__1_0.distcp"),
    "hf_index": ("hf_sharded", "model.safetensors.index.json"),
    "hf_shard": ("hf_sharded", "model-00002-of-00002.safetensors"),
    "orbax_zarray": ("orbax/zarr_step", "params.big/.zarray"),
    "orbax_chunk": ("orbax/zarr_step", "params.big/0.0"),
    "orbax_metadata": ("orbax/zarr_step", "_METADATA"),
}


def _load(path: Path) -> dict[str, np.ndarray]:
    with cv.open(path) as reader:
        return {k: reader[k].read() for k in reader}


mutations = st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4
)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(flips=mutations, cut=st.one_of(st.none(), st.floats(0, 1)))
def test_mutated_files_load_or_raise_ckpt_error(
    case: str,
    flips: list[tuple[float, int]],
    cut: float | None,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rel, target = CASES[case]
    src = FIXTURES / rel
    tmp = tmp_path_factory.mktemp(case)
    if src.is_dir():
        path = tmp / src.name
        shutil.copytree(src, path)
        victim = path / str(target)
    elif target is None:
        path = tmp / src.name
        shutil.copy(src, path)
        victim = path
    else:
        for f in src.parent.glob(src.name + ".*"):
            shutil.copy(f, tmp / f.name)
        path = tmp / src.name
        victim = tmp / target
    original = _load(FIXTURES / rel)
    data = bytearray(victim.read_bytes())
    for where, xor in flips:
        data[int(where * len(data))] ^= xor
    if cut is not None:
        data = data[: int(cut * len(data))]
    victim.write_bytes(bytes(data))
    try:
        loaded = _load(path)
    except CkptError:
        return
    assert all(isinstance(v, np.ndarray) for v in loaded.values())
    if case.startswith("tf"):  # checksummed: nothing damaged may come back
        assert sorted(loaded) == sorted(original)
        for key, value in loaded.items():
            assert value.shape == original[key].shape and value.dtype == original[key].dtype
            np.testing.assert_array_equal(value, original[key])
