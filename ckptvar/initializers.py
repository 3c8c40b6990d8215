"""Initializers: ``init(shape, dtype) -> numpy.ndarray``, as TensorFlow's.

Owns ``zeros``, ``ones``, ``constant(value)``, ``random_uniform``, ``random_normal``,
``truncated_normal``, ``glorot_uniform``, ``glorot_normal``, ``he_normal``, ``orthogonal``
(plus the ``variance_scaling`` family they share) and the fan-in/fan-out rule.

Every public name is a factory: called with keyword parameters (or, for ``constant`` and
the random ones, TensorFlow's positional parameters) it returns an :class:`Initializer`;
called with a shape (a tuple or list; an int for the parameterless ones) it produces an
array with the default parameters, so the parameterless ones can be passed bare
(``initializer=zeros``) or called (``zeros()``). A seeded initializer gives the same values
on every call.

>>> zeros((2,), "int32")
array([0, 0], dtype=int32)
>>> init = random_normal(mean=1.0, stddev=0.5, seed=7)
>>> bool((init((3,), "float32") == init((3,), "float32")).all())
True
>>> glorot_uniform(seed=0)((2, 3)).dtype
dtype('float32')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._dims import as_dims
from ._dtypes import as_dtype, check_value_castable, dtype_name, kind_of
from .errors import DTypeLockError, ShapeLockError

__all__ = [
    "Constant",
    "GlorotNormal",
    "GlorotUniform",
    "HeNormal",
    "Initializer",
    "Ones",
    "Orthogonal",
    "RandomNormal",
    "RandomUniform",
    "TruncatedNormal",
    "VarianceScaling",
    "Zeros",
    "as_initializer",
    "call_initializer",
    "check_produces",
    "compute_fans",
    "constant",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "is_initializer",
    "ones",
    "orthogonal",
    "random_normal",
    "random_uniform",
    "returns_new_arrays",
    "truncated_normal",
    "variance_scaling",
    "zeros",
]

Shape = tuple[int, ...]


def _as_shape(shape: Any) -> Shape:
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    return as_dims(shape, "An initializer's shape")


def compute_fans(shape: Sequence[int]) -> tuple[int, int]:
    """TensorFlow's ``(fan_in, fan_out)``.

    Scalars count 1 and 1; a vector ``(n,)`` counts n and n; a matrix ``(in, out)``
    counts its two dimensions; a convolution kernel ``(*spatial, in, out)`` multiplies
    both by the receptive field ``prod(spatial)``.

    >>> compute_fans((3, 4)), compute_fans((5, 5, 3, 8))
    ((3, 4), (75, 200))
    """
    shape = tuple(shape)
    if len(shape) < 1:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


class Initializer:
    """Base class: ``init(shape, dtype="float32") -> numpy.ndarray``.

    Subclasses implement :meth:`_generate` in float64 (or the exact dtype) and list the
    dtype kinds they can produce in ``kinds``.
    """

    kinds = "fc"  # the NumPy dtype kinds this initializer can produce

    def __call__(self, shape: Any, dtype: Any = None, partition_info: Any = None) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` (default float32). ``partition_info`` (what
        ``get_variable`` passes for one part of a partitioned variable, with ``full_shape``)
        makes the fan-based initializers scale by the whole variable's fans, as TF1 does."""
        shape = _as_shape(shape)
        dt = as_dtype("float32" if dtype is None else dtype)
        check_produces(self, dt)
        if partition_info is None:
            out = self._generate(shape, dt)
        else:
            out = self._generate_part(shape, dt, _as_shape(partition_info.full_shape))
        return np.asarray(out, dtype=dt, order="C")  # (ascontiguousarray would make 0-d 1-d)

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        raise NotImplementedError

    def _generate_part(self, shape: Shape, dtype: np.dtype, full_shape: Shape) -> np.ndarray:
        """One part of a partitioned variable of ``full_shape`` (most initializers: as any)."""
        return self._generate(shape, dtype)

    def get_config(self) -> dict[str, Any]:
        """The parameters this initializer was made with."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)


class Zeros(Initializer):
    kinds = "biufc"

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        return np.zeros(shape, dtype)


class Ones(Initializer):
    kinds = "biufc"

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        return np.ones(shape, dtype)


class Constant(Initializer):
    """Fills with ``value``: a scalar, or an array broadcastable to the shape.

    ``value`` converts to the dtype asked for by the ``same_kind`` rule of every write
    (``1.5`` into int32, ``-1`` into uint8: :class:`~ckptvar.errors.DTypeLockError`).
    """

    kinds = "biufc"

    def __init__(self, value: Any = 0) -> None:
        self.value = value

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        check_value_castable(self.value, dtype, what=f"constant({self.value!r})")
        value = np.asarray(self.value)
        if value.size == 1:
            return np.full(shape, value.reshape(()), dtype=dtype)
        if value.size == math.prod(shape):  # TensorFlow accepts a flat list of the right size
            return value.reshape(shape).astype(dtype)
        try:
            return np.broadcast_to(value, shape).astype(dtype)
        except ValueError:
            raise ShapeLockError(
                f"constant({self.value!r}) has shape {value.shape}, which does not fit shape "
                f"{shape}."
            ) from None

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


class RandomUniform(Initializer):
    """Uniform in ``[minval, maxval)``; ``maxval=None`` means 1 (floats). Ints allowed."""

    kinds = "fiu"

    def __init__(self, minval: float = 0.0, maxval: float | None = None, seed: int | None = None):
        self.minval, self.maxval, self.seed = minval, maxval, seed

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        rng = _rng(self.seed)
        if dtype.kind in "iu":
            if self.maxval is None:
                raise ValueError("random_uniform needs maxval for an integer dtype.")
            for bound in (self.minval, self.maxval):
                if float(bound) != int(bound):  # int() would truncate it silently
                    raise TypeError(
                        f"random_uniform({self.minval!r}, {self.maxval!r}) for dtype "
                        f"{dtype_name(dtype)}: the bounds of an integer range are integers, "
                        f"not {bound!r}."
                    )
            return rng.integers(int(self.minval), int(self.maxval), size=shape, dtype=dtype)
        high = 1.0 if self.maxval is None else self.maxval
        return rng.uniform(self.minval, high, size=shape)

    def get_config(self) -> dict[str, Any]:
        return {"minval": self.minval, "maxval": self.maxval, "seed": self.seed}


class RandomNormal(Initializer):
    """Normal with ``mean`` and ``stddev``."""

    def __init__(self, mean: float = 0.0, stddev: float = 1.0, seed: int | None = None):
        self.mean, self.stddev, self.seed = mean, stddev, seed

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        return _real(dtype, lambda rng, size: rng.normal(self.mean, self.stddev, size), shape,
                     self.seed)

    def get_config(self) -> dict[str, Any]:
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}


def _truncated(rng: np.random.Generator, mean: float, stddev: float, size: Shape) -> np.ndarray:
    """Normal values redrawn until all lie within two standard deviations of the mean."""
    out = rng.standard_normal(size)
    bad = np.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2.0
    return out * stddev + mean


def _real(dtype: np.dtype, draw: Any, shape: Shape, seed: int | None) -> np.ndarray:
    rng = _rng(seed)
    drawn: np.ndarray = draw(rng, shape)
    if dtype.kind == "c":
        imaginary: np.ndarray = draw(rng, shape)
        return drawn + 1j * imaginary
    return drawn


class TruncatedNormal(Initializer):
    """Normal with ``mean`` and ``stddev``, values beyond two stddevs redrawn."""

    kinds = "f"

    def __init__(self, mean: float = 0.0, stddev: float = 1.0, seed: int | None = None):
        self.mean, self.stddev, self.seed = mean, stddev, seed

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        return _truncated(_rng(self.seed), self.mean, self.stddev, shape)

    def get_config(self) -> dict[str, Any]:
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}


class VarianceScaling(Initializer):
    """TensorFlow's variance scaling: ``scale / n`` with ``n`` from ``mode``.

    ``mode`` is ``"fan_in"``, ``"fan_out"`` or ``"fan_avg"``; ``distribution`` is
    ``"truncated_normal"`` (stddev ``sqrt(scale/n) / 0.8796...``, so the truncated
    distribution has the target variance), ``"untruncated_normal"`` or ``"uniform"``
    (limit ``sqrt(3 * scale / n)``).
    """

    kinds = "f"

    def __init__(
        self,
        scale: float = 1.0,
        mode: str = "fan_in",
        distribution: str = "truncated_normal",
        seed: int | None = None,
    ) -> None:
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale!r}.")
        if mode not in ("fan_in", "fan_out", "fan_avg"):
            raise ValueError(f"mode must be 'fan_in', 'fan_out' or 'fan_avg', got {mode!r}.")
        if distribution not in ("truncated_normal", "untruncated_normal", "uniform"):
            raise ValueError(
                "distribution must be 'truncated_normal', 'untruncated_normal' or 'uniform', "
                f"got {distribution!r}."
            )
        self.scale, self.mode, self.distribution, self.seed = scale, mode, distribution, seed

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        return self._generate_part(shape, dtype, shape)

    def _generate_part(self, shape: Shape, dtype: np.dtype, full_shape: Shape) -> np.ndarray:
        # a part of a partitioned variable scales by the whole one's fans (TF1's scale_shape)
        fan_in, fan_out = compute_fans(full_shape)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[self.mode]
        variance = self.scale / max(1.0, n)
        rng = _rng(self.seed)
        if self.distribution == "uniform":
            limit = math.sqrt(3.0 * variance)
            return rng.uniform(-limit, limit, size=shape)
        if self.distribution == "untruncated_normal":
            return rng.normal(0.0, math.sqrt(variance), size=shape)
        return _truncated(rng, 0.0, math.sqrt(variance) / 0.87962566103423978, shape)

    def get_config(self) -> dict[str, Any]:
        return {"scale": self.scale, "mode": self.mode, "distribution": self.distribution,
                "seed": self.seed}


class GlorotUniform(VarianceScaling):
    """Uniform in ``±sqrt(6 / (fan_in + fan_out))`` (Xavier)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(1.0, "fan_avg", "uniform", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class GlorotNormal(VarianceScaling):
    """Truncated normal with stddev ``sqrt(2 / (fan_in + fan_out))`` (before truncation)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(1.0, "fan_avg", "truncated_normal", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class HeNormal(VarianceScaling):
    """Truncated normal with stddev ``sqrt(2 / fan_in)`` (before truncation)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(2.0, "fan_in", "truncated_normal", seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class Orthogonal(Initializer):
    """A (semi-)orthogonal matrix times ``gain``, reshaped: rows are ``prod(shape[:-1])``."""

    kinds = "f"

    def __init__(self, gain: float = 1.0, seed: int | None = None) -> None:
        self.gain, self.seed = gain, seed

    def _generate(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        if len(shape) < 2:
            raise ShapeLockError(
                f"orthogonal needs a shape of at least 2 dimensions, got {shape}.")
        rows, cols = math.prod(shape[:-1]), shape[-1]
        flat = (max(rows, cols), min(rows, cols))
        a = _rng(self.seed).standard_normal(flat)
        q, r = np.linalg.qr(a)
        q = q * np.sign(np.diag(r))  # makes the decomposition unique (uniform over O(n))
        if rows < cols:
            q = q.T
        return self.gain * q.reshape(shape)

    def get_config(self) -> dict[str, Any]:
        return {"gain": self.gain, "seed": self.seed}


# --- the public factories ---------------------------------------------------------------------


def _looks_like_shape(value: Any, *, ints_too: bool) -> bool:
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return ints_too
    if isinstance(value, tuple | list):
        return all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in value)
    return False


class _Factory:
    """A public initializer name: makes configured initializers, or acts as the default one.

    ``f(**params)`` (and ``f(*tf_positional_params)``) -> an :class:`Initializer`;
    ``f(shape, dtype=None)`` -> an array from the default-configured initializer.
    """

    def __init__(self, cls: type[Initializer], name: str, *, shape_first: str) -> None:
        self._cls, self.__name__, self._shape_first = cls, name, shape_first
        self.__qualname__ = name
        self.__doc__ = cls.__doc__
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and self._shape_first != "never" and _looks_like_shape(
            args[0], ints_too=self._shape_first == "always"
        ):
            if len(args) > 2 or set(kwargs) - {"dtype", "partition_info"}:
                raise TypeError(f"{self.__name__}(shape, dtype) takes no other arguments.")
            return self._cls()(*args, **kwargs)
        if args and self._shape_first != "never" and isinstance(args[0], tuple | list):
            # meant as a shape, but not one: "Zeros() takes no arguments" would not say so
            raise ValueError(
                f"{self.__name__}({args[0]!r}): a shape is a tuple or list of non-negative "
                "ints (an initializer makes a fully defined shape, no None)."
            )
        return self._cls(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<initializer factory {__name__}.{self.__name__}>"


zeros = _Factory(Zeros, "zeros", shape_first="always")
ones = _Factory(Ones, "ones", shape_first="always")
constant = _Factory(Constant, "constant", shape_first="never")
random_uniform = _Factory(RandomUniform, "random_uniform", shape_first="sequence")
random_normal = _Factory(RandomNormal, "random_normal", shape_first="sequence")
truncated_normal = _Factory(TruncatedNormal, "truncated_normal", shape_first="sequence")
variance_scaling = _Factory(VarianceScaling, "variance_scaling", shape_first="sequence")
glorot_uniform = _Factory(GlorotUniform, "glorot_uniform", shape_first="always")
glorot_normal = _Factory(GlorotNormal, "glorot_normal", shape_first="always")
he_normal = _Factory(HeNormal, "he_normal", shape_first="always")
orthogonal = _Factory(Orthogonal, "orthogonal", shape_first="always")


def is_initializer(obj: Any) -> bool:
    """Whether ``obj`` is meant to be called as ``init(shape, dtype)``.

    True for ckptvar initializers and factories, initializer classes, and any callable
    whose signature requires at least one positional argument. A zero-argument callable
    (``lambda: np.zeros(3)``) is an initial-value function instead.
    """
    import inspect  # noqa: PLC0415 - only needed for foreign callables

    if isinstance(obj, Initializer | _Factory):
        return True
    if isinstance(obj, type):
        return issubclass(obj, Initializer)
    if not callable(obj) or hasattr(obj, "__array__") or hasattr(obj, "shape"):
        return False
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return bool(required)


def check_produces(init: Any, dtype: Any, what: str = "") -> None:
    """Raise :class:`~ckptvar.errors.DTypeLockError` (a ``TypeError``) when ``init``, one
    of ckptvar's initializers (an instance, factory or class), cannot produce ``dtype``
    (``glorot_uniform`` makes floats only); ``what`` says for what (a variable). Any other
    callable is not checked.

    >>> check_produces(zeros, "int32"); check_produces(glorot_uniform, "int32", "'k'")
    Traceback (most recent call last):
    ...
    ckptvar.errors.DTypeLockError: 'k': GlorotUniform cannot produce dtype int32; it supports kinds 'f' (f=float, i/u=int, b=bool, c=complex).
    """
    cls = init._cls if isinstance(init, _Factory) else init if isinstance(init, type) else type(init)
    if not issubclass(cls, Initializer):
        return
    dt = as_dtype(dtype)
    if (kind_of(dt) or dt.kind) not in cls.kinds:  # bfloat16, float8: floats; int4: an integer
        raise DTypeLockError(
            f"{what + ': ' if what else ''}{cls.__name__} cannot produce dtype "
            f"{dtype_name(dt)}; it supports kinds {cls.kinds!r} (f=float, i/u=int, b=bool, "
            "c=complex)."
        )


def returns_new_arrays(obj: Any) -> bool:
    """Whether ``obj`` is one of ckptvar's initializers (an instance, factory or class),
    whose every call returns a new array a variable may adopt without a copy; a user's
    initializer may return an array it keeps.

    >>> returns_new_arrays(zeros), returns_new_arrays(GlorotUniform), returns_new_arrays(len)
    (True, True, False)
    """
    if isinstance(obj, type):
        return issubclass(obj, Initializer)
    return isinstance(obj, Initializer | _Factory)


def call_initializer(init: Any, shape: Shape, dtype: np.dtype) -> Any:
    """Run ``init`` (an initializer, factory or class) for ``shape`` and ``dtype``.

    A factory passed bare is its default-configured initializer (``constant``: zeros, as a
    bare ``tf.constant_initializer`` is in TensorFlow 1), never called with the shape as
    its first parameter.

    >>> call_initializer(constant, (2,), np.dtype("float32"))
    array([0., 0.], dtype=float32)
    """
    return as_initializer(init)(tuple(shape), dtype)


def as_initializer(init: Any) -> Any:
    """``init`` ready to call: a class instantiated, a factory passed bare made with its
    defaults (``constant``: zeros); anything else as it is.

    >>> as_initializer(constant)((2,), "int32"), as_initializer(len) is len
    (array([0, 0], dtype=int32), True)
    """
    if isinstance(init, type):
        return init()
    if isinstance(init, _Factory):
        return init._cls()
    return init
