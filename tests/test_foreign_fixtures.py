"""What is particular to each real fixture (made by TF, Keras, PyTorch, safetensors, NumPy):
TF object keys and slices, torch views and nesting, Keras names, safetensors metadata.

That every tensor reads back bit-exact, lazily and whole, is the ReaderTests suite's
(tests/test_foreign_readers.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = json.loads((ROOT / "manifest.json").read_text())["files"]
SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"

DTYPE_NAMES = {  # producer dtype names -> numpy names
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
    "BOOL": "bool", "U8": "uint8", "I32": "int32",
}


def _shown(fmt: str, key: str) -> str:
    return key[: -len(SUFFIX)] if fmt == "tf" and key.endswith(SUFFIX) else key


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def test_cv_load_returns_numpy_arrays_for_each_format() -> None:
    values = cv.load(ROOT / "tf2_object" / "ckpt-1")
    assert "model/dense/kernel" in values and "_CHECKPOINTABLE_OBJECT_GRAPH" not in values
    assert values["model/bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert isinstance(values["model/steps"], np.ndarray)
    listed = cv.list_variables(ROOT / "tf1_saver" / "model.ckpt")
    assert ("embedding", (10, 3), np.dtype("float32")) in [(k, tuple(s), d) for k, s, d in listed]
    w = cv.load_variable(ROOT / "torch" / "state_dict.pt", "0.weight")
    assert w.shape == (3, 4) and w.dtype == np.float32


def test_tf_object_keys_accept_the_full_key_and_skip_the_object_graph() -> None:
    with cv.open(ROOT / "tf2_object" / "ckpt-1") as reader:
        full = "model/dense/kernel" + SUFFIX
        assert full in reader
        np.testing.assert_array_equal(reader[full].read(), reader["model/dense/kernel"].read())
        assert "_CHECKPOINTABLE_OBJECT_GRAPH" not in reader
        assert "_CHECKPOINTABLE_OBJECT_GRAPH" not in reader.skipped  # bookkeeping, not a value
        assert reader.skipped == {}
        assert "_CHECKPOINTABLE_OBJECT_GRAPH" in reader.bookkeeping
        with pytest.raises(cv.UnsupportedFormatError, match="object graph"):
            reader["_CHECKPOINTABLE_OBJECT_GRAPH"]
        with pytest.raises(KeyError, match="model/dense/kernl"):
            reader["model/dense/kernl"]
        assert reader.info("model/dense/kernel").checksum is not None


def test_tf_partitioned_variable_is_reassembled_from_its_slices() -> None:
    with cv.open(ROOT / "tf1_saver" / "model.ckpt.index") as reader:
        assert reader.info("embedding").shape == (10, 3)  # 3 slices along axis 0
        assert reader.info("wide").shape == (2, 7)  # 2 slices along axis 1
        np.testing.assert_array_equal(reader["wide"][:, 3:5], reader["wide"].read()[:, 3:5])
        assert not any(k.startswith("\x00") for k in reader)


def test_torch_views_of_one_storage_keep_their_own_strides() -> None:
    with cv.open(ROOT / "torch" / "state_dict.pt") as reader:
        base = reader["shared.base"].read()
        np.testing.assert_array_equal(base, np.arange(24, dtype=np.float32).reshape(4, 6))
        np.testing.assert_array_equal(reader["shared.transposed"].read(), base.T)
        np.testing.assert_array_equal(reader["shared.column"].read(), base[:, 2])
        np.testing.assert_array_equal(reader["shared.row_offset"].read(), base[3])
        np.testing.assert_array_equal(reader["shared.every_other"].read(), base[::2, 1::3])
        np.testing.assert_array_equal(reader["shared.transposed"][2:4, 1], base.T[2:4, 1])


def test_torch_nested_checkpoint_flattens_keys_and_keeps_plain_values_as_metadata() -> None:
    with cv.open(ROOT / "torch" / "nested.pth") as reader:
        assert "model.0.weight" in reader and "param" in reader
        assert reader.info("param").attrs.get("parameter") is True
        assert reader.metadata() == {"epoch": 3, "name": "fixture", "history.0": 0.5,
                                     "history.1": 0.25}


def test_keras_files_use_the_names_keras_gives() -> None:
    with cv.open(ROOT / "keras" / "tiny.weights.h5") as reader:
        assert reader.format == "keras"
        assert reader.info("layers/dense/vars/0").attrs["layer"] == "hidden"
    with cv.open(ROOT / "keras" / "tiny_legacy.h5") as reader:  # .h5 suffix: found by sniffing
        assert reader.format == "keras"
        assert list(reader.keys())[:2] == ["hidden/kernel:0", "hidden/bias:0"]


def test_safetensors_metadata_is_returned() -> None:
    with cv.open(ROOT / "safetensors" / "model.safetensors") as reader:
        assert reader.metadata() == {"format": "np", "note": "fixture"}


def test_readers_never_import_the_frameworks() -> None:
    code = (
        "import sys, ckptvar as cv, pathlib\n"
        f"root = pathlib.Path({str(ROOT)!r})\n"
        f"for name in {sorted(MANIFEST)!r}:\n"
        "    cv.load(root / name)\n"
        "bad = [m for m in ('torch', 'tensorflow', 'keras', 'safetensors', 'jax') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_files_are_closed_by_the_reader() -> None:
    import gc
    import os
    import time

    def open_fixtures() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(ROOT)):
                out.append(target)
        return out

    before = open_fixtures()  # readers other tests have not closed yet
    for name in sorted(MANIFEST):
        with cv.open(ROOT / name) as reader:
            for key in reader:
                reader[key].read()
            if MANIFEST[name]["format"] != "orbax":  # Orbax: each chunk file read whole, closed
                assert len(open_fixtures()) > len(before)  # the reader holds its files
        if MANIFEST[name]["format"] == "orbax":
            # an OCDBT store's files are opened and closed by tensorstore on its own threads:
            # the store is released with the reader, its descriptors a moment later
            deadline = time.monotonic() + 5
            while open_fixtures() != before and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.02)
        assert open_fixtures() == before


def test_latest_checkpoint_reads_tensorflows_checkpoint_file(tmp_path: Path) -> None:
    """A TensorFlow training directory (its ``checkpoint`` state file naming the prefix):
    cv.latest_checkpoint returned None, as for an empty directory, so restoring or
    listing 'the latest' of it found nothing (tf.train.latest_checkpoint returns the
    prefix)."""
    run = tmp_path / "tf_run"
    shutil.copytree(ROOT / "tf2_object", run)
    assert cv.latest_checkpoint(run) is None  # no state file: nothing is guessed
    (run / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n'
                                    'all_model_checkpoint_paths: "ckpt-1"\n')
    assert cv.latest_checkpoint(run) == str(run / "ckpt-1")
    assert cv.list_variables(run) == cv.list_variables(run / "ckpt-1")
    absolute = tmp_path / "absolute"
    absolute.mkdir()
    (absolute / "checkpoint").write_text(f'model_checkpoint_path: "{run / "ckpt-1"}"\n')
    assert cv.latest_checkpoint(absolute) == str(run / "ckpt-1")
    (run / "checkpoint").write_text('model_checkpoint_path: "ckpt-9"\n')  # gone
    assert cv.latest_checkpoint(run) is None
    mine = cv.Checkpoint(w=cv.Variable([1.0], name="w")).save(run / "mine")
    assert cv.latest_checkpoint(run) == mine  # a ckptvar checkpoint comes first
