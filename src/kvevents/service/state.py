"""The state file of ``kvevents serve --state-file``: registrations that survive a restart.

Workers registered over HTTP are written here after every change, atomically (a temporary
file in the same directory, flushed to disk, renamed over the old one): a crash leaves the old
file or the new one, never half of one (and a temporary file, removed at the next start). At
start the service reads it and registers them again, writing nothing until all are
(``IndexService.restore``).

A file that cannot be read or is not a state file is an error naming the file: the service
does not start. Moving it aside and starting empty would look healthy while every worker that
registered over HTTP is silently forgotten; refusing makes the operator choose (fix the file,
or remove it to start empty). A missing file is a first start: nothing to restore.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from kvevents.files import read_bounded
from kvevents.service.bounds import MAX_RANKS, BlockSize, EndpointText, Name, Rank, Text
from kvevents.service.feed import OwnEndpoints, WorkerRegistration

__all__ = [
    "MAX_STATE_BYTES",
    "Persisted",
    "StateFile",
    "StateFileError",
    "decode_registrations",
    "encode_registrations",
]

log = logging.getLogger("kvevents.service.state")

#: The largest state file read. 8,192 workers (the subscriber's socket limit) with every
#: string at its bound take about 25 MB; more is not a state file this service wrote.
MAX_STATE_BYTES = 64 << 20


class StateFileError(ValueError):
    """The state file cannot be read or is not one; the message names the file."""


class _Worker(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    worker_id: Name
    endpoint: EndpointText
    block_size: BlockSize
    ranks: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]
    replay_endpoint: EndpointText | None = None
    topic: Text = ""
    model_name: Text | None = None
    # Ranks registered one at a time: [rank, endpoint, replay_endpoint or null].
    own_endpoints: list[tuple[Rank, EndpointText, EndpointText | None]] = []
    report_mode: Literal["incremental", "full"] = "incremental"


class _State(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    version: Literal[1]
    workers: list[_Worker]


_decoder = msgspec.json.Decoder(_State)


def encode_registrations(regs: list[WorkerRegistration]) -> bytes:
    """``regs`` in the state file's format (also the registrations of a replica's snapshot)."""
    workers = [_saved(r) for r in regs]
    return msgspec.json.format(msgspec.json.encode(_State(version=1, workers=workers)))


def decode_registrations(data: bytes) -> list[WorkerRegistration]:
    """The registrations of :func:`encode_registrations`; ``msgspec.DecodeError`` if the
    bytes are not that format."""
    return [_registration(w) for w in _decoder.decode(data).workers]


class StateFile:
    """Registrations kept in one JSON file at ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> list[WorkerRegistration]:
        """The saved registrations ([] when the file does not exist); StateFileError otherwise."""
        try:
            data = read_bounded(self.path, MAX_STATE_BYTES, "state file")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StateFileError(f"state file {self.path}: {exc.strerror or exc}") from None
        try:
            return decode_registrations(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise StateFileError(
                f"state file {self.path}: not a kvevents state file ({exc}); fix it, or remove "
                "it to start without the workers registered over HTTP"
            ) from None

    def save(self, regs: list[WorkerRegistration]) -> None:
        """Replace the file with ``regs``, atomically; OSError if it cannot be written."""
        payload = encode_registrations(regs)
        directory = self.path.parent
        fd, tmp = tempfile.mkstemp(prefix=self._temporary_prefix, suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(payload + b"\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _sync_directory(directory)

    def remove_stale_temporaries(self) -> int:
        """Remove the temporary files a killed writer left next to the file (how many). Call
        it at start, before this process writes: one service per state file, so no write of
        anyone else's is under way."""
        removed = 0
        for stale in self.path.parent.glob(f"{glob.escape(self._temporary_prefix)}*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
                removed += 1
        return removed

    @property
    def _temporary_prefix(self) -> str:
        return f".{self.path.name}."

    def check_writable(self) -> None:
        """StateFileError unless the file's directory takes a new file (checked at start,
        so a wrong path fails there and not at the first registration)."""
        if not os.access(self.path.parent, os.W_OK | os.X_OK):
            raise StateFileError(f"state file {self.path}: its directory is not writable")


class Persisted:
    """Which workers go to the state file (those registered with ``persist``), and writing it.

    The service calls it with its change lock held; without a file it tracks nothing to write.
    """

    def __init__(self, state: StateFile | None) -> None:
        self.state = state
        self._ids: set[str] = set()
        #: (registered so far, to register) while a restore runs (:meth:`begin_restore`), else None.
        self.restore_progress: tuple[int, int] | None = None
        self._owed = False  # a write was asked for during the restore

    def begin_restore(self, total: int) -> None:
        """Hold every write until :meth:`end_restore`: the file already holds the workers
        being registered again, and a write half-way would hold only those restored so far
        (a kill then loses the rest for good)."""
        self.restore_progress = (0, total)
        self._owed = False

    def restored_one(self) -> None:
        """Count one registration of the restore done (or refused)."""
        if self.restore_progress is not None:
            done, total = self.restore_progress
            self.restore_progress = (done + 1, total)

    def end_restore(self) -> bool:
        """End the restore; whether a change made meanwhile (over HTTP) is owed a write."""
        owed, self._owed = self._owed, False
        self.restore_progress = None
        return owed and self.state is not None

    def defer(self) -> bool:
        """Whether a write asked for now waits for the restore's end (then it is owed)."""
        if self.restore_progress is None:
            return False
        self._owed = True
        return True

    def registered(self, worker_id: str, persist: bool) -> bool:
        """Note a registration; whether the file must be written again."""
        was = worker_id in self._ids
        if persist:
            self._ids.add(worker_id)
        else:
            self._ids.discard(worker_id)  # the settings' own worker now: not the file's
        return self.state is not None and (persist or was)

    def unregistered(self, worker_id: str, gone: bool) -> bool:
        """Note an unregistration (``gone``: no rank left); whether to write the file."""
        was = worker_id in self._ids
        if gone:
            self._ids.discard(worker_id)
        return self.state is not None and was

    def write(self, workers: Mapping[str, WorkerRegistration]) -> bool:
        """Write the persisted ones of ``workers``; False (logged) if the file was not written."""
        if self.state is None:
            return True
        try:
            self.state.save([reg for wid, reg in workers.items() if wid in self._ids])
        except OSError:
            log.exception("state file %s: not written", self.state.path)
            return False
        return True


def _saved(reg: WorkerRegistration) -> _Worker:
    return _Worker(
        worker_id=reg.worker_id,
        endpoint=reg.endpoint,
        block_size=reg.block_size,
        ranks=list(reg.ranks),
        replay_endpoint=reg.replay_endpoint,
        topic=reg.topic,
        model_name=reg.model_name,
        own_endpoints=[(e.rank, e.endpoint, e.replay_endpoint) for e in reg.own_endpoints],
        report_mode=reg.report_mode,
    )


def _registration(w: _Worker) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=w.worker_id,
        endpoint=w.endpoint,
        block_size=w.block_size,
        ranks=tuple(sorted(set(w.ranks))),
        replay_endpoint=w.replay_endpoint,
        topic=w.topic,
        model_name=w.model_name,
        own_endpoints=tuple(OwnEndpoints(*e) for e in w.own_endpoints),
        report_mode=w.report_mode,
    )


def _sync_directory(directory: Path) -> None:
    # The rename is durable once the directory entry is on disk; not every platform lets a
    # directory be opened for that, and the file itself is already whole either way.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
