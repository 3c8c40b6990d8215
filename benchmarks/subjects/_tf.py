"""TensorFlow's ``tf.train.Checkpoint`` (run by the interpreter of its own venv)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject
from benchmarks.workloads import Spec, fill


def _tf_escape(name: str) -> str:
    return name.replace(".", "..").replace("/", ".S")


class TF(Subject):
    """tf.train.Checkpoint of tf.Variables kept in a dict on a tf.Module."""

    name = "tf"
    suffix = ".tfckpt"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf

        self.tf = tf

    def _checkpoint(self, variables: dict[str, Any]) -> Any:
        m = self.tf.Module()
        m.params = variables
        return self.tf.train.Checkpoint(model=m)

    def prepare_save(self, spec: Spec) -> Any:
        # one NumPy input at a time: TensorFlow copies it, and the next one reuses its pages
        return self._checkpoint({k: self.tf.Variable(fill(k, np.empty(s, np.float32)))
                                 for k, s in spec})

    def save(self, path: str, ckpt: Any) -> None:
        ckpt.write(path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        r = self.tf.train.load_checkpoint(path)
        out = {}
        suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
        for full in r.get_variable_to_shape_map():
            if full.startswith("model/params/") and full.endswith(suffix):
                name = full[len("model/params/") : -len(suffix)]
                name = name.replace(".S", "/").replace("..", ".")
                out[name] = r.get_tensor(full)
        return out

    def prepare_restore(self, spec: Spec) -> Any:
        variables = {k: self.tf.Variable(self.tf.ones(s, self.tf.float32)) for k, s in spec}
        return self._checkpoint(variables), variables

    def restore(self, path: str, prepared: Any) -> Any:
        ckpt, _ = prepared
        ckpt.read(path).assert_consumed()

    def restored_arrays(self, prepared: Any) -> dict[str, np.ndarray]:
        _, variables = prepared
        return {k: v.numpy() for k, v in variables.items()}

    def read_one(self, path: str, key: str) -> np.ndarray:
        r = self.tf.train.load_checkpoint(path)
        return r.get_tensor(f"model/params/{_tf_escape(key)}/.ATTRIBUTES/VARIABLE_VALUE")
