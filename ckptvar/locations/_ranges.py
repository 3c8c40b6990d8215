"""Planning and following ranged reads: ranges merged into requests, bytes to their owners.

Which byte ranges go in one request, and where each byte of a streamed response belongs.

Owns :func:`plan_requests` (ranges merged across small gaps, as obstore's
``get_ranges`` merges them, and cut into requests of bounded size) and
:class:`Cursor` (hands each chunk of a response to the ranges it covers, dropping the
bytes of gaps, and says when a range is complete). :class:`RequestStats` counts the requests and bytes. :mod:`._object` does the HTTP.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Sequence

__all__ = ["COALESCE", "MAX_REQUEST", "Cursor", "RequestStats", "SinkError", "plan_requests"]

#: Ranges less than this apart are fetched by one request (obstore's ``get_ranges`` default).
COALESCE = 1024 * 1024
#: One request never asks for more than this (its whole body must arrive within ``timeout``).
MAX_REQUEST = 4 << 30


class SinkError(Exception):
    """Wraps an error raised by a sink, so that it is not taken for a cut-off body."""


class Cursor:
    """Where one request's response is: the next byte expected, and the range it fills."""

    __slots__ = (
        "end", "k", "lengths", "offsets", "on_done", "pos", "req", "sink", "start", "whole",
    )

    def __init__(
        self,
        req: builtins.list[int],
        offsets: Sequence[int],
        lengths: Sequence[int],
        sink: Callable[[int, int, memoryview], None],
        on_done: Callable[[int], None] | None,
    ) -> None:
        self.req, self.offsets, self.lengths = req, offsets, lengths
        self.sink, self.on_done = sink, on_done
        self.start = self.pos = offsets[req[0]]
        self.end = offsets[req[-1]] + lengths[req[-1]]
        self.k = 0
        #: The object's size, when the request asks for all of it (no ``Range``).
        self.whole: int | None = None

    def feed(self, chunk: memoryview) -> int:
        """Hand one chunk of the response to the ranges it covers (gaps dropped);
        returns how many of its bytes were asked for."""
        m = min(chunk.nbytes, self.end - self.pos)
        at = 0
        while at < m:
            j = self.req[self.k]
            lo, n = self.offsets[j], self.lengths[j]
            if self.pos < lo:  # a gap between two ranges
                step = min(lo - self.pos, m - at)
            else:
                step = min(lo + n - self.pos, m - at)
                try:
                    self.sink(j, self.pos - lo, chunk[at : at + step])
                except BaseException as exc:
                    raise SinkError() from exc
            at += step
            self.pos += step
            if self.pos == lo + n:
                self.k += 1
                if self.on_done is not None:
                    try:
                        self.on_done(j)
                    except BaseException as exc:
                        raise SinkError() from exc
        return m


def plan_requests(
    offsets: Sequence[int], lengths: Sequence[int], limit: int
) -> builtins.list[builtins.list[int]]:
    """Range indices grouped into requests: by offset, merged across gaps below
    ``COALESCE``, a request closed once it spans ``limit`` bytes. Overlapping ranges
    go to separate requests (a stream fills one range at a time); empty ranges to none."""
    order = sorted((j for j in range(len(offsets)) if lengths[j] > 0), key=offsets.__getitem__)
    requests: builtins.list[builtins.list[int]] = []
    cur: builtins.list[int] = []
    lo = end = 0
    for j in order:
        off, n = offsets[j], lengths[j]
        if cur and (off < end or off - end >= COALESCE or off + n - lo > limit):
            requests.append(cur)
            cur = []
        if not cur:
            lo = off
        cur.append(j)
        end = off + n
    if cur:
        requests.append(cur)
    return requests


class RequestStats:
    """Counts of requests and payload bytes at this layer's boundary (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.get_requests = self.bytes_read = 0
        self.put_requests = self.bytes_written = 0
        self.other_requests = 0

    def add(self, kind: str, nbytes: int = 0) -> None:
        with self._lock:
            if kind == "get":
                self.get_requests += 1
                self.bytes_read += nbytes
            elif kind == "put":
                self.put_requests += 1
                self.bytes_written += nbytes
            elif kind == "bytes":  # payload of a streamed GET
                self.bytes_read += nbytes
            elif kind == "upload":  # bytes handed to a multipart writer
                self.bytes_written += nbytes
            else:
                self.other_requests += 1

    def reset(self) -> None:
        with self._lock:
            self.get_requests = self.bytes_read = 0
            self.put_requests = self.bytes_written = 0
            self.other_requests = 0
