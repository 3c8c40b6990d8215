"""A step's claim: who is writing it, and when a dead writer's claim stops blocking.

A writer that writes at a step's own key (a Zarr tree, a multi-process step) first
creates ``<step>.claim`` with a create-only write. The claim names its holder:
the writer's id, the job (``SLURM_JOB_ID`` and the like), the host, the process
id and its start time, when the claim was last renewed and its lease::

    {"ckptvar_claim": 1, "writer": "<uuid4 hex>", "job": "4242", "host": "node7",
     "pid": 1234, "started": "98765", "time": 1764036000.0, "lease": 60.0}

The holder renews it (rewrites ``time``) every quarter lease while it writes. A
claim stops blocking once its holder is gone:

- on the same host: at once, when its process no longer exists (or another
  process has its id: the start time differs), or when that process released it
  (a claim whose delete failed, the network being down, never blocks its own process);
- from another host: when it was not renewed for a lease (a later writer waits
  that long, at most, then takes the step over).

Taking over is itself create-only: the taker first creates
``<step>.claim.<dead writer>.takeover``, so of writers racing for a dead claim one
wins; it deletes what the dead writer left below the step and writes its own claim. A live holder that finds its
claim replaced (it was paused for longer than a lease) stops before its commit.
Claims written before holders were recorded (a bare id) count as dead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from ..errors import CheckpointExistsError, CheckpointNotFoundError
from ._base import Location, clean_key
from ._names import this_host

__all__ = ["CLAIM_LEASE", "CLAIM_SUFFIX", "Claim", "Holder", "claim", "process_alive",
           "read_claim"]

logger = logging.getLogger("ckptvar")

CLAIM_SUFFIX = ".claim"
#: Seconds a claim holds without renewal (the holder renews it every quarter of this).
CLAIM_LEASE = 60.0
_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "TORCHELASTIC_RUN_ID")
#: Writer ids of the claims this process released but could not delete: never blocking.
_released: set[str] = set()


def _stat(pid: int) -> tuple[str, str]:
    """The process's state letter and start time in clock ticks since boot (Linux's
    ``/proc/<pid>/stat``), or ``("", "")`` where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError):
        return "", ""


def _started(pid: int) -> str:
    return _stat(pid)[1]


def process_alive(pid: int, started: str = "") -> bool:
    """Whether process ``pid`` of this host runs (and, given ``started``, is that one).

    A killed process not yet reaped by its parent (a zombie) is not alive.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    state, start = _stat(pid)
    if state in ("Z", "X", "x"):
        return False
    return not started or start in ("", started)


@dataclass(frozen=True)
class Holder:
    """Who holds a claim (see the module docstring)."""

    writer: str
    job: str
    host: str
    pid: int
    started: str
    time: float
    lease: float

    @classmethod
    def mine(cls, lease: float = CLAIM_LEASE) -> Holder:
        job = next((os.environ[v] for v in _JOB_VARS if os.environ.get(v)), "")
        return cls(uuid.uuid4().hex, job, this_host(), os.getpid(), _started(os.getpid()),
                   time.time(), float(lease))

    def to_json(self) -> bytes:
        return json.dumps({"ckptvar_claim": 1, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Holder | None:
        """The holder a claim names; ``None`` for a claim that names none (older ones)."""
        try:
            doc = json.loads(raw)
            return cls(str(doc["writer"]), str(doc["job"]), str(doc["host"]), int(doc["pid"]),
                       str(doc["started"]), float(doc["time"]), float(doc["lease"]))
        except (ValueError, KeyError, TypeError):
            return None

    def gone(self, now: float | None = None) -> bool:
        """Whether this holder is known to be gone (see the module docstring)."""
        if self.writer in _released:
            return True
        if self.host == this_host():
            return not process_alive(self.pid, self.started)
        return (time.time() if now is None else now) - self.time > self.lease

    def describe(self) -> str:
        job = f"job {self.job}, " if self.job else ""
        return f"{job}host {self.host}, pid {self.pid}, renewed at {time.ctime(self.time)}"


def read_claim(location: Location, step: str) -> tuple[bool, Holder | None]:
    """``(exists, holder)`` of the step's claim (``holder`` is ``None`` for an old claim)."""
    try:
        raw = location.read(clean_key(step) + CLAIM_SUFFIX)
    except CheckpointNotFoundError:
        return False, None
    return True, Holder.from_json(raw)


class Claim:
    """A claim this process holds: renewed in the background until :meth:`release`."""

    def __init__(self, location: Location, step: str, holder: Holder) -> None:
        self.location = location
        self.step = clean_key(step)
        self.key = self.step + CLAIM_SUFFIX
        self.holder = holder
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name=f"ckptvar-claim-{self.step}")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.holder.lease / 4):
            try:
                _, now = read_claim(self.location, self.step)
                if now is None or now.writer != self.holder.writer:
                    self.lost = True
                    return
                self.holder = Holder(**{**asdict(self.holder), "time": time.time()})
                self.location.put(self.key, self.holder.to_json())
            except Exception as exc:  # noqa: BLE001 - a renewal that failed is retried
                logger.warning("Could not renew the claim %s: %s", self.location.join(self.key),
                               exc)

    def check(self) -> None:
        """Raise ``CheckpointExistsError`` if another writer took the step over."""
        if self.lost:
            raise CheckpointExistsError(
                f"step {self.location.join(self.step)}: this writer's claim was taken over "
                f"(it was not renewed for {self.holder.lease:.0f} s); nothing is committed"
            )

    def release(self) -> None:
        """Stop renewing and delete the claim (if it is still this writer's).

        A delete that fails (the store unreachable) is logged, not raised: it would hide
        what the save raised or fail a committed one; the claim no longer blocks anyone
        (this process counts it gone) and the next save reclaims it, as ``ckpt gc`` does once
        this process has ended.
        """
        self._stop.set()
        self._thread.join()
        try:
            _, now = read_claim(self.location, self.step)
            if now is not None and now.writer == self.holder.writer:
                self.location.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - a leftover claim is reclaimed later
            _released.add(self.holder.writer)
            logger.warning("Could not delete the claim %s (it is reclaimed by the next save "
                           "or ckpt gc): %s", self.location.join(self.key), exc)


def claim(location: Location, step: str, *, lease: float = CLAIM_LEASE) -> Claim:
    """Take ``step`` for this writer before it writes at the step's own key.

    A claim whose holder is gone is taken over (its leftovers below the step
    deleted); one held from another host and not renewed is waited for, at most a
    lease. Of two live writers, the second gets ``CheckpointExistsError`` naming
    the claim and its holder.
    """
    step = clean_key(step)
    key = step + CLAIM_SUFFIX
    seen: Holder | None = None
    while True:
        mine = Holder.mine(lease)
        try:
            location.put(key, mine.to_json(), create_only=True)
            return Claim(location, step, mine)
        except CheckpointExistsError:
            pass
        exists, holder = read_claim(location, step)
        if not exists:
            continue  # released meanwhile
        if holder is None or holder.gone():
            taken = _take_over(location, step, holder, mine)
            if taken is not None:
                return taken
            continue
        if holder.host == this_host() or (seen is not None and holder.time != seen.time):
            raise CheckpointExistsError(
                f"step {location.join(step)} is being written by another writer (claim "
                f"{location.join(key)}: {holder.describe()}); two writers never both "
                "commit a step"
            )
        seen = holder  # another host's: wait for a renewal, or for the lease to run out
        time.sleep(max(0.05, min(1.0, holder.time + holder.lease - time.time() + 0.05)))


def _take_over(location: Location, step: str, dead: Holder | None, mine: Holder) -> Claim | None:
    """Replace the claim of the ``dead`` holder by ``mine``; ``None`` if another writer is
    taking it over (it holds the create-only takeover token of that holder)."""
    key = step + CLAIM_SUFFIX
    token = f"{key}.{dead.writer if dead else 'unnamed'}.takeover"
    try:
        location.put(token, mine.to_json(), create_only=True)
    except CheckpointExistsError:
        try:
            other = Holder.from_json(location.read(token))
        except CheckpointNotFoundError:
            return None
        if other is None or other.gone():  # a taker that died in turn
            location.delete(token)
        else:
            time.sleep(0.05)
        return None
    try:
        who = dead.describe() if dead else "a writer that did not say who it was"
        logger.warning("Taking over step %s: its claim was held by %s, which is gone.",
                       location.join(step), who)
        location.delete_prefix(step + "/")
        location.put(key, mine.to_json())  # the claim is now this writer's
    finally:
        location.delete(token)
    return Claim(location, step, mine)
