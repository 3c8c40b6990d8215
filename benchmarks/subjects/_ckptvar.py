"""ckptvar through its public API (``import ckptvar as cv``), and its model builder."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.subjects.base import Subject
from benchmarks.workloads import Spec, fill, make_arrays


def cv_segment(key: str) -> str:
    return key.replace("/", ".")


class CkptVar(Subject):
    """ckptvar through its public API.

    ``api="checkpoint"`` (default): a ``cv.Module`` holding a dict of ``cv.Variable``
    saved with ``cv.Checkpoint(model=...).write(path)``; keys are
    ``model/params/<name with '.' for '/'>``. ``api="save"``: ``cv.save(path, arrays,
    **write_options)`` with the workload's own keys (how writer options such as
    ``durable=False`` are reached). ``api="saver"``: the variables in a list through
    ``cv.Saver(var_list=...)`` (keys: the variables' names, the workload's own), its
    ``save`` and ``restore``. ``cv.load`` results are mapped back to the workload's
    names; ``verify=False`` in the options turns checksums off on load.
    """

    name = "ckptvar"
    PREFIX = "model/params/"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import ckptvar as cv

        self.cv = cv
        self.format = options["format"]
        self.suffix = "." + self.format
        self.api = options.get("api", "checkpoint")
        self.write_options = dict(options.get("write_options") or {})
        self.verify = bool(options.get("verify", True))

    def _module(self, variables: dict[str, Any]) -> Any:
        m = self.cv.Module(name="model")
        m.params = variables
        return m

    def prepare_save(self, spec: Spec) -> Any:
        if self.api == "save":
            return make_arrays(spec)
        cv = self.cv
        if self.api == "saver":
            return cv.Saver(var_list=self._filled(spec), max_to_keep=None)
        variables = {}
        for k, s in spec:  # filled in place: one allocation per variable, no input copy
            v = cv.Variable(cv.initializers.zeros(), shape=s, dtype="float32", name=k,
                            device="CPU:0")
            fill(k, np.asarray(v.value()))
            variables[cv_segment(k)] = v
        return cv.Checkpoint(model=self._module(variables))

    def _filled(self, spec: Spec) -> list[Any]:
        """The workload's variables, named by its keys, holding its values."""
        cv = self.cv
        out = []
        for k, s in spec:
            v = cv.Variable(cv.initializers.zeros(), shape=s, dtype="float32", name=k,
                            device="CPU:0")
            fill(k, np.asarray(v.value()))
            out.append(v)
        return out

    def save(self, path: str, prepared: Any) -> None:
        if self.api == "save":
            self.cv.save(path, prepared, **self.write_options)
        elif self.api == "saver":
            prepared.save(path)  # the suffix names the format; no step number
        else:
            prepared.write(path)

    def key(self, name: str) -> str:
        return name if self.api in ("save", "saver") else self.PREFIX + cv_segment(name)

    def unkey(self, key: str) -> str | None:
        if self.api in ("save", "saver"):
            return key
        if not key.startswith(self.PREFIX):
            return None  # save_counter
        return key[len(self.PREFIX):].replace(".", "/")

    def load(self, path: str) -> dict[str, np.ndarray]:
        got = self.cv.load(path, verify=self.verify)
        out = {}
        for k, v in got.items():
            name = self.unkey(k)
            if name is not None:
                out[name] = v
        return out

    def prepare_restore(self, spec: Spec) -> Any:
        cv = self.cv
        if self.api == "saver":
            variables = {k: cv.Variable(cv.initializers.ones(), shape=s, dtype="float32",
                                        name=k, device="CPU:0") for k, s in spec}
            materialize(variables)
            return cv.Saver(var_list=list(variables.values()), max_to_keep=None), variables
        variables = {cv_segment(k): cv.Variable(cv.initializers.ones(), shape=s,
                                                  dtype="float32", name=k, device="CPU:0")
                     for k, s in spec}
        ckpt = cv.Checkpoint(model=self._module(variables))
        materialize(variables)  # the buffers exist (and are backed) before the timed call
        return ckpt, variables

    def restore(self, path: str, prepared: Any) -> Any:
        ckpt, _ = prepared  # a Checkpoint, or a Saver
        return ckpt.restore(path, verify=self.verify)

    def restored_arrays(self, prepared: Any) -> dict[str, np.ndarray]:
        _, variables = prepared
        return {(k if self.api == "saver" else k.replace(".", "/")): np.asarray(v.value())
                for k, v in variables.items()}

    def read_one(self, path: str, key: str) -> np.ndarray:
        with self.cv.open(path) as r:
            return r[self.key(key)].read(verify=self.verify)

    def load_gpu(self, path: str) -> dict[str, Any]:
        import cupy as cp

        got = self.cv.load(path, device="GPU:0", verify=self.verify)
        cp.cuda.runtime.deviceSynchronize()
        return {name: v for k, v in got.items() if (name := self.unkey(k)) is not None}


class Model:
    """Builds the workload's Variables from initializers (for restore-as-initialization)."""

    def __init__(self, cv: Any, spec: Spec) -> None:
        self.cv, self.spec = cv, spec

    def build(self) -> tuple[Any, dict[str, Any]]:
        cv = self.cv
        init = cv.initializers.random_normal(stddev=0.02, seed=1)
        variables = {cv_segment(k): cv.Variable(init, shape=s, dtype="float32", name=k,
                            device="CPU:0")
                     for k, s in self.spec}
        m = cv.Module(name="model")
        m.params = variables
        return m, variables


def materialize(variables: dict[str, Any]) -> None:
    """Force every variable's value into memory (a restore may be applied lazily)."""
    for v in variables.values():
        v.value()
