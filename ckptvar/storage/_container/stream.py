"""Many values of a remote container, streamed: few long GETs, values handed out as they land.

Owns :func:`stream_many`, the object-store form of :func:`.bulk.read_many`. The
values' byte ranges are handed to their object's location in one call
(``Location.stream_ranges``), which merges adjacent ranges into one request (so an
HDF5 checkpoint is one GET) and streams each response straight into the values'
arrays. The arrays are allocated (and their pages touched) by a helper thread running
ahead of the streams, so page faults overlap the network rather than slow the copies.
Each value is hashed as its bytes arrive, so it is verified as soon as it is complete, and handed out then. At most
``window`` bytes are allocated ahead of what has been handed out, so a consumer that
drops each value keeps memory bounded when the values are asked for in the order
they are stored (the streams never wait while the consumer waits for a value: asked
in another order, more may be held).
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...errors import CkptError, CorruptCheckpointError
from .. import checksum as _checksum
from .. import rawio as _rawio
from .._record import Entry
from .access import ValueAccess, compare
from .source import RemoteFile

__all__ = ["stream_many", "streamable"]

#: Objects streamed at once (each one response at a time).
_OBJECTS_IN_FLIGHT = 8
#: Arrays at least this large have their pages touched when allocated.
_TOUCH_FROM = 64 << 10


class _Closed(CkptError):
    """The consumer went away: the streams stop."""


def streamable(reader: ValueAccess, todo: list[tuple[str, Entry]]) -> bool:
    """Whether the values can be streamed: remote, and no key asked twice."""
    if len({k for k, _ in todo}) != len(todo):
        return False
    return all(isinstance(reader.source(k, e).fd, RemoteFile) for k, e in todo)


class _Streams:
    """The shared state of the streams (producers) and the consumer."""

    def __init__(
        self, reader: ValueAccess, todo: list[tuple[str, Entry]], window: int
    ) -> None:
        self.reader, self.todo, self.window = reader, todo, window
        n = len(todo)
        self.arrays: list[np.ndarray | None] = [None] * n
        self.views: list[memoryview | None] = [None] * n
        self.crcs = [0] * n
        self.got = [0] * n
        self.done = [False] * n
        self.failed: list[BaseException | None] = [None] * n
        self.cond = threading.Condition()
        self.ahead = 0  # bytes allocated and not yet handed out
        self.waiting = False  # the consumer waits for a value not yet complete
        self.closed = False

    # -- the allocator and the producers
    def allocate_all(self, order: list[int]) -> None:
        """Allocate the arrays in the order the streams fill them, at most ``window``
        bytes ahead of the consumer (beyond, while it waits for a value)."""
        try:
            for t in order:
                key, e = self.todo[t]
                with self.cond:
                    while not (
                        self.ahead == 0 or self.ahead + e.nbytes <= self.window or self.waiting
                    ):
                        if self.closed:
                            return
                        self.cond.wait()
                    if self.closed:
                        return
                    self.ahead += e.nbytes
                arr = np.empty(e.shape, e.np_dtype)
                if e.nbytes >= _TOUCH_FROM:
                    arr.fill(0)  # fault the pages in here, not under the copies
                view = _rawio.byte_view(arr)
                with self.cond:
                    self.crcs[t] = _checksum.header_crc(key, e.dtype, e.shape)
                    self.views[t], self.arrays[t] = view, arr
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer (out of memory)
            with self.cond:
                self.closed = True
                for t in order:
                    if not self.done[t]:
                        self.failed[t] = exc
                self.cond.notify_all()

    def allocated(self, t: int) -> memoryview:
        """Value ``t``'s byte view, once the allocator has made it."""
        view = self.views[t]
        if view is None:
            with self.cond:
                while (view := self.views[t]) is None:
                    if self.closed:
                        raise _Closed("the read stopped")
                    self.cond.wait()
        return view

    def run(self, rf: RemoteFile, items: list[tuple[int, int]]) -> None:
        """Stream one object's values (``(index, offset)``, in offset order)."""
        todo = self.todo

        def sink(j: int, pos: int, chunk: memoryview) -> None:
            t = items[j][0]
            view = self.allocated(t)
            view[pos : pos + chunk.nbytes] = chunk
            self.crcs[t] = _checksum.crc(chunk, self.crcs[t])
            self.got[t] += chunk.nbytes

        def on_done(j: int) -> None:
            with self.cond:
                self.done[items[j][0]] = True
                self.cond.notify_all()

        try:
            rf.location.stream_ranges(
                rf.key,
                [at for _, at in items],
                [todo[t][1].nbytes for t, _ in items],
                sink,
                on_done=on_done,
                **({"size": rf.size} if rf.base == 0 else {}),
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            with self.cond:
                for t, _ in items:
                    if not self.done[t] and self.failed[t] is None:
                        self.failed[t] = exc
                self.cond.notify_all()

    # -- the consumer
    def take(self, t: int, verify: bool) -> np.ndarray:
        """Wait for value ``t``, check it, and hand it out."""
        key, e = self.todo[t]
        with self.cond:
            if not self.done[t] and self.failed[t] is None:
                self.waiting = True  # past the window if need be: the streams must go on
                self.cond.notify_all()
                while not self.done[t] and self.failed[t] is None:
                    self.cond.wait()
                self.waiting = False
            failed = self.failed[t]
        if isinstance(failed, CorruptCheckpointError):  # the object is short
            raise self.reader.corrupt(
                key, f"is truncated: {self.got[t]} of {e.nbytes} bytes present"
            ) from None
        if failed is not None:
            raise failed
        if e.nbytes == 0:  # no byte streamed, and maybe not allocated yet
            self.allocated(t)
        arr = self.arrays[t]
        assert arr is not None
        if self.got[t] != e.nbytes:
            raise self.reader.corrupt(
                key, f"is truncated: {self.got[t]} of {e.nbytes} bytes present"
            )
        if verify and self.crcs[t] != e.checksum:
            compare(self.reader, key, e, self.crcs[t])
        with self.cond:
            self.ahead -= e.nbytes
            self.arrays[t] = self.views[t] = None
            self.cond.notify_all()
        return arr

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def stream_many(
    reader: ValueAccess, todo: list[tuple[str, Entry]], verify: bool, window: int
) -> Generator[np.ndarray, None, None]:
    """The values of ``todo`` (checked by :func:`streamable`), in order, each verified.

    Nothing is fetched before the first value is asked for.
    """
    state = _Streams(reader, todo, window)
    by_object: dict[tuple[int, str], tuple[RemoteFile, list[tuple[int, int]]]] = {}
    for t, (key, e) in enumerate(todo):
        src = reader.source(key, e)
        rf = src.fd
        assert isinstance(rf, RemoteFile)
        _, items = by_object.setdefault((id(rf.location), rf.key), (rf, []))
        items.append((t, rf.base + src.offset))
    order: list[int] = []
    for _, items in by_object.values():
        items.sort(key=lambda item: item[1])
        order += [t for t, _ in items]
    pool = ThreadPoolExecutor(min(_OBJECTS_IN_FLIGHT, len(by_object)) + 1,
                              thread_name_prefix="ckptvar-stream")
    try:
        pool.submit(state.allocate_all, order)
        for rf, items in by_object.values():
            pool.submit(state.run, rf, items)
        for t in range(len(todo)):
            yield state.take(t, verify)
    finally:
        state.close()
        pool.shutdown(wait=True, cancel_futures=True)
