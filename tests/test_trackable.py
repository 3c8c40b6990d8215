"""The trackable protocol, Python state in checkpoints, keys and the object-graph walk."""

from __future__ import annotations

import collections
import random
import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ckptvar as cv
from ckptvar.checkpoint._keys import escape_segment, join_key, split_key, unescape_segment
from ckptvar.checkpoint._serialize import decode_state
from ckptvar.checkpoint._walk import walk


class TrainState(cv.Trackable):
    """A step counter, an RNG state and a config dict, kept as plain Python."""

    def __init__(self, seed: int = 0) -> None:
        self.step = 0
        self.rng = random.Random(seed)
        self.config = {"lr": 0.1, "layers": [64, 64], "name": "run"}

    def python_state(self) -> Any:
        version, internal, gauss = self.rng.getstate()
        return {"step": self.step, "rng": [version, list(internal), gauss], "config": self.config}

    def restore_python_state(self, state: Any) -> None:
        self.step = state["step"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.config = state["config"]


def test_python_state_round_trips(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    s = TrainState(seed=1)
    s.step = 41
    s.rng.random()
    expected_next = random.Random()
    expected_next.setstate(s.rng.getstate())
    ckpt = cv.Checkpoint(state=s, w=cv.Variable([1.0, 2.0], name="w"))
    path = ckpt.save(tmp_path / "ckpt", format=fmt)

    s2 = TrainState(seed=99)
    status = cv.Checkpoint(state=s2, w=cv.Variable([0.0, 0.0], name="w2")).restore(path)
    status.assert_consumed()
    assert s2.step == 41
    assert s2.config == {"lr": 0.1, "layers": [64, 64], "name": "run"}
    assert s2.rng.random() == expected_next.random()


def test_python_state_of_an_object_attached_after_restore(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    s = TrainState()
    s.step = 7
    path = cv.Checkpoint(state=s).save(tmp_path / "ckpt", format=fmt)
    ckpt = cv.Checkpoint()
    status = ckpt.restore(path)
    later = TrainState()
    ckpt.state = later
    assert later.step == 7
    status.assert_consumed()


def test_state_that_msgpack_cannot_store_is_refused(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    class Bad(cv.Trackable):
        def python_state(self) -> Any:
            return {"x": object()}

    with pytest.raises(TypeError, match="'bad'.*msgpack"):
        cv.Checkpoint(bad=Bad()).save(tmp_path / "ckpt")
    assert not list(tmp_path.iterdir())


def test_state_without_restore_method_fails_clearly(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    class OneWay(cv.Trackable):
        def python_state(self) -> Any:
            return 1

    path = cv.Checkpoint(x=OneWay()).save(tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"restore_python_state\(state\)"):
        cv.Checkpoint(x=OneWay()).restore(path)


def test_track_and_defer_protocol(fresh_graph: cv.Graph) -> None:
    t = cv.Trackable()
    seen: list[tuple[str, Any]] = []
    t.defer_restore("child", lambda parent, name, value: seen.append((name, value)))
    v = cv.Variable(1.0)
    assert t.deferred_names() == ["child"]
    t.track("other", v)
    assert seen == []
    t.track("child", v)
    t.track("child", v)  # a handler runs once
    assert seen == [("child", v)]
    assert list(t.trackable_children()) == ["other", "child"]
    t.untrack("other")
    assert list(t.trackable_children()) == ["child"]
    with pytest.raises(ValueError, match="non-empty"):
        t.track("", v)


def test_the_private_spellings_of_earlier_versions_are_still_honoured(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    class Old(cv.Trackable):
        def __init__(self) -> None:
            self.n = 0
            self.w = cv.Variable([1.0, 2.0], name="old_w")

        def _trackable_children(self) -> dict[str, Any]:
            return {"w": self.w}

        def _python_state(self) -> Any:
            return {"n": self.n}

        def _restore_python_state(self, state: Any) -> None:
            self.n = state["n"]

    old = Old()
    old.n = 5
    with pytest.warns(DeprecationWarning) as record:
        path = cv.Checkpoint(x=old).save(tmp_path / "ckpt")
    said = " ".join(str(w.message) for w in record)
    assert "Old overrides _trackable_children()" in said and "_python_state()" in said
    assert "x/w" in {name for name, _, _ in cv.list_variables(path)}
    back = Old()
    back.w.assign([0.0, 0.0])
    with pytest.warns(DeprecationWarning, match="_restore_python_state"):
        cv.Checkpoint(x=back).restore(path).assert_consumed()  # the others: warned already
    assert back.n == 5 and back.w.numpy().tolist() == [1.0, 2.0]
    # the old aliases of the calls still work, and the old hook answers the new name
    t = cv.Trackable()
    t._track("a", back.w)
    assert list(t._trackable_children()) == ["a"] and t._deferred_names() == []


def test_an_attribute_named_like_the_protocol_does_not_hide_it(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    s = TrainState()
    s.step = 3
    ckpt = cv.Checkpoint(state=s, python_state=cv.Variable([1.0], name="ps"))
    path = ckpt.save(tmp_path / "ckpt")
    other = TrainState()
    cv.Checkpoint(state=other, python_state=cv.Variable([0.0], name="ps2")).restore(path)
    assert other.step == 3

    class Named(cv.Module):  # attributes named like the protocol's methods are tracked
        def __init__(self) -> None:
            super().__init__()
            self.track = cv.Variable([1.0], name="t")
            self.trackable_children = cv.Variable([2.0], name="c")

    named = Named()
    assert [v.name for v in named.variables] == ["t", "c"]
    ckpt = cv.Checkpoint(track=named, untrack=cv.Variable([4.0], name="u"))
    keys = {k for k, _, _ in cv.list_variables(ckpt.save(tmp_path / "named"))}
    assert {"track/track", "track/trackable_children", "untrack"} <= keys


def test_key_escaping() -> None:
    assert join_key(["model", "layers", "0", "kernel"]) == "model/layers/0/kernel"
    assert escape_segment("a/b") == "a%2Fb" and escape_segment("50%") == "50%25"
    assert split_key("a%2Fb/c%252F") == ["a/b", "c%2F"]
    with pytest.raises(ValueError, match="empty"):
        escape_segment("")
    with pytest.raises(ValueError, match="Bad escape"):
        unescape_segment("%41")


@given(st.lists(st.text(min_size=1), min_size=1, max_size=5))
def test_keys_round_trip(names: list[str]) -> None:
    key = join_key(names)
    assert split_key(key) == names
    assert key.count("/") == len(names) - 1


def test_walk_is_breadth_first_and_records_aliases(fresh_graph: cv.Graph) -> None:
    shared = cv.Variable(1.0, name="shared")
    deep = cv.Trackable()
    deep._track("v", shared)
    root = cv.Trackable()
    root._track("deep", deep)
    root._track("list", [cv.Variable(2.0, name="x"), {"k/1": shared}])
    nodes = [(n.key, n.first) for n in walk(root)]
    assert nodes == [
        ("", True),
        ("deep", True),
        ("list", True),
        ("deep/v", True),
        ("list/0", True),
        ("list/1", True),
        ("list/1/k%2F1", False),
    ]


def test_walk_survives_cycles(fresh_graph: cv.Graph) -> None:
    a, b = cv.Trackable(), cv.Trackable()
    a._track("b", b)
    b._track("a", a)
    b._track("v", cv.Variable(1.0))
    assert [n.key for n in walk(a) if n.first] == ["", "b", "b/v"]


def test_dict_keys_that_cannot_name_a_value(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(d={(1, 2): cv.Variable(1.0), 3: cv.Variable(2.0)})
    with pytest.raises(TypeError, match=r"\(1, 2\)"):
        ckpt.save(tmp_path / "ckpt")


def test_a_checkpoint_refuses_arrays_in_a_container(tmp_path: Path,
                                                    fresh_graph: cv.Graph) -> None:
    """Arrays in a list or dict given to a checkpoint were left out of every save, silently
    (a JAX or NumPy pytree saved nothing): they are refused, naming each, with the way
    to save them; other values left out are said; an array put in later is said at the
    save that leaves it out."""
    with pytest.raises(TypeError, match=r"'params/w' \(numpy.ndarray\).*'params/b/0'.*"
                                        r"cv\.Variable.*cv\.save"):
        cv.Checkpoint(params={"w": np.ones(3), "b": [np.zeros(2)], "v": cv.Variable(1.0)})
    with pytest.raises(TypeError, match=r"'opt/1' \(numpy.float32\)"):
        cv.Checkpoint(opt=[cv.Variable(1.0), np.float32(2.0)])
    with pytest.warns(UserWarning, match=r"'cfg/lr' is neither a variable nor a trackable "
                                         r"object: a save leaves it out"):
        ckpt = cv.Checkpoint(cfg={"lr": 0.1, "v": cv.Variable(2.0, name="v")})
    ckpt.cfg["late"] = np.ones(2)
    with pytest.warns(UserWarning, match=r"'cfg/late' is a numpy.ndarray in a container.*"
                                         r"not saved"):
        path = ckpt.write(tmp_path / "c.h5")
    assert sorted(cv.load(path)) == ["cfg/v"]


def test_a_checkpoint_refuses_torch_modules_in_a_container(tmp_path: Path,
                                                           fresh_graph: cv.Graph) -> None:
    """A torch module or optimizer is tracked as a checkpoint's own argument only (its
    state dict, restored as a whole); in a list or dict it was left out of every save,
    a whole model, with a warning that called it neither a variable nor a trackable:
    it is refused, naming each, with the way to save them."""
    torch = pytest.importorskip("torch")
    gen, disc = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(gen.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"'models/gen' \(torch.nn.modules.linear.Linear\), "
                                        r"'models/disc' .*Checkpoint\(gen=\.\.\., disc=\.\.\.\)"):
        cv.Checkpoint(models={"gen": gen, "disc": disc})
    with pytest.raises(TypeError, match=r"'parts/1' \(torch.optim.sgd.SGD\)"):
        cv.Checkpoint(parts=[cv.Variable(1.0), opt])
    ckpt = cv.Checkpoint(gen=gen, opt=opt)  # each its own argument: saved
    assert any(k.startswith("gen") for k in cv.load(ckpt.write(tmp_path / "c.h5")))
    later = cv.Checkpoint(parts=[cv.Variable(1.0, name="v")])
    later.parts.append(disc)  # put in after: said at the save that leaves it out
    with pytest.warns(UserWarning, match=r"'parts/1' is a torch.nn.modules.linear.Linear "
                                         r"in a container.*own argument"):
        path = later.write(tmp_path / "later.h5")
    assert sorted(cv.load(path)) == ["parts/0"]


class Holder(cv.Trackable):
    """Keeps whatever Python state it is given."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def python_state(self) -> Any:
        return self.state

    def restore_python_state(self, state: Any) -> None:
        self.state = state


def test_tuples_in_python_state_come_back_as_tuples(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    point = collections.namedtuple("point", "x y")
    state = {"pair": (1, 2), "nested": [(3, (4, [5, (6,)])), []], 7: ((),), "p": point(8, 9),
             "list": [1, 2]}
    path = cv.Checkpoint(h=Holder(state), top=Holder((1, [2, (3,)]))).save(
        tmp_path / "ckpt", format=fmt)
    h, top = Holder(), Holder()
    with pytest.warns(UserWarning, match=r"'h' held namedtuples that come back as plain "
                                         r"tuples: p \(.*point\)"):
        cv.Checkpoint(h=h, top=top).restore(path).assert_consumed()
    assert h.state == {"pair": (1, 2), "nested": [(3, (4, [5, (6,)])), []], 7: ((),),
                       "p": (8, 9), "list": [1, 2]}
    assert type(h.state["nested"]) is list and type(h.state["nested"][0][1][1]) is list
    assert type(h.state["p"]) is tuple  # nothing here gives it its type: said
    assert type(h.state["list"]) is list
    assert top.state == (1, [2, (3,)]) and type(top.state[1]) is list
    # a plain reader still sees arrays: the state is plain msgpack, the tuples listed beside
    with cv.open(path) as reader:
        graph = reader.metadata()["object_graph"]
    assert msgpack.unpackb(graph["python_state"]["h"], strict_map_key=False)["pair"] == [1, 2]


class Point(NamedTuple):
    x: int
    y: Any


class Other(NamedTuple):
    a: int
    b: Any


def test_namedtuples_in_python_state_take_their_type_from_the_restoring_object(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    state = {"p": Point(1, Point(2, "z")), "ps": [Point(3, None)], "t": (4, 5)}
    path = cv.Checkpoint(h=Holder(state), top=Holder(Point(6, [7]))).save(tmp_path / "ckpt")
    like = {"p": Point(0, Point(0, "")), "ps": [Point(0, 0)], "t": (0, 0)}
    h, top = Holder(like), Holder(Point(0, []))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every namedtuple has its type here: nothing said
        cv.Checkpoint(h=h, top=top).restore(path).assert_consumed()
    assert h.state == state and type(h.state["p"]) is Point and type(h.state["p"].y) is Point
    assert type(h.state["ps"][0]) is Point and type(h.state["t"]) is tuple
    assert type(top.state) is Point and top.state == Point(6, [7])
    # the type is the restoring object's, never one a file names (fields matched by count)
    other = Holder({"p": Other(0, Other(0, "")), "ps": [None], "t": (0, 0)})
    with pytest.warns(UserWarning, match=r"'h' held namedtuples .*: ps/0 \(.*Point\)\."):
        cv.Checkpoint(h=other).restore(path).expect_partial()
    assert type(other.state["p"]) is Other and type(other.state["p"].b) is Other
    assert type(other.state["ps"][0]) is tuple and other.state["ps"][0] == (3, None)


def test_a_tuple_as_a_map_key_of_python_state_is_refused(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    with pytest.raises(TypeError, match=r"'h'.*\(1, 2\)"):
        cv.Checkpoint(h=Holder({"a": {(1, 2): 3}})).save(tmp_path / "ckpt")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("paths", [[[5]], [[0]], "x", [[], []], [[{"a": 1}]]])
def test_damaged_tuple_places_are_a_corrupt_checkpoint(paths: Any) -> None:
    with pytest.raises(cv.CorruptCheckpointError, match=r"'h' in 'f\.h5'"):
        decode_state(msgpack.packb([1, 2]), "h", "f.h5", paths)


def test_a_child_that_is_no_variable_nor_trackable_is_said(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    """A value a trackable names as its child (``track``, ``trackable_children``) that a
    checkpoint cannot save (an array, a number) was left out of the save without a word."""

    class Named(cv.Trackable):
        def trackable_children(self) -> dict[str, Any]:
            return {"v": cv.Variable([1.0], name="v"), "lr": 0.1}

    box = cv.Trackable()
    box.track("mask", np.ones(3))
    with pytest.warns(UserWarning) as said:
        path = cv.Checkpoint(box=box, named=Named()).save(tmp_path / "ckpt")
    text = "\n".join(str(w.message) for w in said)
    assert "'box/mask' is a numpy.ndarray, a child of Trackable" in text
    assert re.search(r"'named/lr' is a builtins.float, a child of \S*Named: .*not saved", text)
    assert [k for k, _, _ in cv.list_variables(path)] == ["save_counter", "named/v"]
