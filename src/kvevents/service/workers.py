"""The index service's registrations: workers' ranks in, their streams followed, and out.

:class:`ServiceWorkers` is a base of :class:`kvevents.service.core.IndexService`. A change of
registrations is one step under the ``_changes`` lock: validated, swapped in the index and the
feed and, when the feed refuses a stream, rolled back. Load reports are accepted here too, as
they are only taken for registered ranks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

from kvevents.errors import LayoutError, RegistrationConflict, StreamAddError, SubscriberError
from kvevents.index.decision import Target
from kvevents.index.prefix import PrefixIndex
from kvevents.index.router import Router
from kvevents.service.feed import Feed, WorkerRegistration
from kvevents.service.loadreports import LoadLedger, LoadReport
from kvevents.service.state import Persisted
from kvevents.subscribe.streams import StreamSpec

__all__ = ["ServiceWorkers"]


class ServiceWorkers:
    """Registering and unregistering workers (a base class of ``IndexService``)."""

    index: PrefixIndex
    router: Router
    lock: threading.Lock
    _changes: threading.Lock
    _workers: dict[str, WorkerRegistration]
    _stream_specs: Callable[[WorkerRegistration], list[StreamSpec]]
    _loads: LoadLedger
    _persisted: Persisted
    _counts: dict[str, int]

    @property
    def feed(self) -> Feed:
        raise NotImplementedError  # the service's own

    def stream_specs(self, reg: WorkerRegistration) -> list[StreamSpec]:
        """The streams ``reg`` would add; ``LayoutError`` (a ``ValueError``) if an endpoint
        breaks a rule. Pure: nothing is registered."""
        return self._stream_specs(reg)

    def register(self, reg: WorkerRegistration, *, persist: bool = True) -> list[StreamSpec]:
        """Index a worker's ranks and subscribe to them; re-registering replaces.

        ``persist``: keep it in the state file (if the service has one); False for the
        workers of the service's own configuration, which it registers at every start.

        Everything is checked before anything changes: endpoints that break a rule raise
        ``LayoutError`` and a stream the feed refuses raises
        :class:`~kvevents.errors.StreamAddError`, and in both cases a worker registered before
        keeps its old registration and streams.
        """
        specs = self._stream_specs(reg)
        with self._changes:
            self._replace(reg, specs, persist)
        return specs

    def restore(
        self,
        regs: Sequence[WorkerRegistration],
        check: Callable[[StreamSpec], None] | None = None,
    ) -> list[tuple[WorkerRegistration, Exception]]:
        """Register a state file's workers again (persisted, as over HTTP), without writing
        the file for them: it holds them already, and a write half-way would hold only those
        registered so far. A change made meanwhile (over HTTP) is written once, at the end;
        it wins over the file's registration of the same worker. ``health()`` says
        ``starting`` until the end.

        ``check`` raises ``LayoutError`` for a stream to refuse (the endpoint policy of now);
        its worker is then not registered. The workers refused (``LayoutError``,
        ``StreamAddError``) are returned with why; they leave the file at its next write.
        """
        refused: list[tuple[WorkerRegistration, Exception]] = []
        self._persisted.begin_restore(len(regs))
        try:
            for reg in regs:
                try:
                    self._restore_one(reg, check)
                except (LayoutError, StreamAddError) as exc:
                    refused.append((reg, exc))
                self._persisted.restored_one()
        finally:
            with self._changes:
                if self._persisted.end_restore():
                    self._save()
        return refused

    def _restore_one(
        self, reg: WorkerRegistration, check: Callable[[StreamSpec], None] | None
    ) -> None:
        specs = self._stream_specs(reg)
        if check is not None:
            for spec in specs:
                check(spec)
        with self._changes:
            if reg.worker_id not in self._workers:  # else registered over HTTP meanwhile
                self._replace(reg, specs, persist=True, save=False)

    def _replace(
        self, reg: WorkerRegistration, specs: list[StreamSpec], persist: bool, save: bool = True
    ) -> None:
        """:meth:`register` with ``_changes`` held (``save``: write the state file if it
        keeps the worker; a restore's own registrations are in it already)."""
        old = self._workers.get(reg.worker_id)
        if old is not None:
            self._drop(old, None)
        try:
            self._add(reg, specs)
        except StreamAddError:
            self._counts["refused_registrations"] += 1
            if old is not None:
                self._add(old, self._stream_specs(old))
            raise
        self._registered(reg.worker_id, persist, save)

    def _registered(self, worker_id: str, persist: bool, save: bool = True) -> None:
        """Count a registration made and write the state file if it is kept there."""
        self._counts["registrations"] += 1
        if self._persisted.registered(worker_id, persist) and save:
            self._save()

    def add_rank(
        self,
        reg: WorkerRegistration,
        *,
        replace: bool = True,
        persist: bool = True,
        one_size_per_model: bool = False,
    ) -> list[StreamSpec]:
        """Register one rank on endpoints of its own (``reg`` has one rank, in its
        ``own_endpoints``) next to the worker's other ranks, which keep their streams.

        A new worker is registered as :meth:`register` does. For a known one, a rank already
        registered is replaced when ``replace`` (its stream alone starts afresh), else
        refused; a model name or block size other than the worker's is refused. Refusals raise
        :class:`~kvevents.errors.RegistrationConflict` and, as in :meth:`register`,
        ``LayoutError`` and ``StreamAddError`` leave everything as it was.
        ``one_size_per_model``: refuse a block size other than that of the model's other
        workers too (Dynamo keeps one per model).
        """
        if len(reg.ranks) != 1 or reg.own(reg.ranks[0]) is None:
            raise ValueError("add_rank takes one rank, with its own endpoints")
        own = reg.own_endpoints[0]
        (spec,) = self._stream_specs(reg)
        with self._changes:
            if one_size_per_model:
                self._check_model_size(reg)
            old = self._workers.get(reg.worker_id)
            if old is None:
                self._replace(reg, [spec], persist)
                return [spec]
            _check_fits(old, reg, own.rank, replace)
            if own.rank in old.ranks:
                self._drop(old, own.rank)
            try:
                self._add_one(old.with_rank(own), spec)
            except StreamAddError:
                if own.rank in old.ranks:  # the rank it replaced comes back
                    with contextlib.suppress(StreamAddError):
                        self._add_one(old, self._spec_of(old, own.rank))
                raise
            self._registered(reg.worker_id, persist)
        return [spec]

    def _check_model_size(self, reg: WorkerRegistration) -> None:
        """RegistrationConflict when another worker of ``reg``'s model has another block size."""
        for other in self._workers.values():
            if other.model_name == reg.model_name and other.block_size != reg.block_size:
                raise RegistrationConflict(
                    worker_id=reg.worker_id,
                    rank=reg.ranks[0],
                    field="block_size",
                    existing=other.block_size,
                    requested=reg.block_size,
                )

    def _spec_of(self, reg: WorkerRegistration, rank: int) -> StreamSpec:
        return next(s for s in self._stream_specs(reg) if s.rank == rank)

    def _add_one(self, merged: WorkerRegistration, spec: StreamSpec) -> None:
        """Add one rank's stream as ``merged``, or (StreamAddError) leave the others as
        they were."""
        with self.lock:
            self.index.register_worker(
                merged.worker_id,
                block_size=merged.block_size,
                ranks=(spec.rank,),
                report_mode=merged.report_mode,
            )
            self._workers[merged.worker_id] = merged
        try:
            self.feed.add_stream(spec)
        except (SubscriberError, ValueError) as exc:
            self._counts["refused_registrations"] += 1
            self._forget(merged, spec.rank)
            raise (exc if isinstance(exc, StreamAddError) else _add_error(spec, exc)) from exc

    def _add(self, reg: WorkerRegistration, specs: list[StreamSpec]) -> None:
        """Register ``reg`` in the index and the feed, or (StreamAddError) not at all."""
        with self.lock:
            self.index.register_worker(
                reg.worker_id,
                block_size=reg.block_size,
                ranks=reg.ranks,
                report_mode=reg.report_mode,
            )
            self._workers[reg.worker_id] = reg
        added: list[StreamSpec] = []
        for spec in specs:
            try:
                self.feed.add_stream(spec)
            except (SubscriberError, ValueError) as exc:
                refused = exc if isinstance(exc, StreamAddError) else _add_error(spec, exc)
                for done in added:
                    # The feed may have dropped a stream it could not keep: nothing to undo.
                    with contextlib.suppress(KeyError):
                        self.feed.remove_stream(done.worker_id, done.rank)
                self._forget(reg, None)
                raise refused from exc
            added.append(spec)

    def unregister(self, worker_id: str, rank: int | None = None) -> bool:
        """Stop following a worker (or one rank) and drop its blocks. False if unknown."""
        with self._changes:
            reg = self._workers.get(worker_id)
            if reg is None or (rank is not None and rank not in reg.ranks):
                return False
            self._drop(reg, rank)
            if self._persisted.unregistered(worker_id, worker_id not in self._workers):
                self._save()
            return True

    def _drop(self, reg: WorkerRegistration, rank: int | None) -> None:
        self.feed.remove_stream(reg.worker_id, rank)
        self._forget(reg, rank)

    def _forget(self, reg: WorkerRegistration, rank: int | None) -> None:
        """Drop a worker (or one rank) from the index, the router and the registrations."""
        worker_id = reg.worker_id
        with self.lock:
            self.index.remove_worker(worker_id, rank)
            self.router.loads.remove(worker_id, rank)
            self._loads.forget(worker_id, rank)
            self.router.mark_healthy(worker_id, rank)
            if rank is None or reg.ranks == (rank,):
                del self._workers[worker_id]
            else:
                self._workers[worker_id] = reg.without(rank)

    def _save(self) -> None:
        """Write the state file (call with ``_changes`` held). A failed write is counted, not
        raised: the change itself was made, and the next one writes the whole state again.
        During a restore the write waits for its end (:meth:`restore`)."""
        if self._persisted.defer():
            return
        written = self._persisted.write(self._workers)
        self._counts["state_writes" if written else "state_write_errors"] += 1

    def _model_targets(self, model_name: str) -> list[Target]:
        """The (worker, rank) targets serving ``model_name`` (call with the lock): those
        registered for it, and those registered with no model name, which serve any."""
        return [
            (reg.worker_id, rank)
            for reg in self._workers.values()
            if reg.model_name in (model_name, None)
            for rank in reg.ranks
        ]

    def report_loads(self, reports: Sequence[LoadReport]) -> list[Target]:
        """Apply load reports for routing; the targets not registered (not applied)."""
        unknown: list[Target] = []
        with self.lock:
            for report in reports:
                reg = self._workers.get(report.worker_id)
                if reg is None or report.rank not in reg.ranks:
                    unknown.append((report.worker_id, report.rank))
                else:
                    self._loads.apply(report)
            self._counts["load_reports"] += len(reports) - len(unknown)
            self._counts["load_unknown"] += len(unknown)
        return unknown


def _check_fits(old: WorkerRegistration, new: WorkerRegistration, rank: int, replace: bool) -> None:
    """RegistrationConflict unless rank ``rank`` of ``new`` may join ``old``'s ranks (the
    model first, as Dynamo checks it: a rank of another model is not "already registered")."""
    for name in ("model_name", "block_size", "report_mode"):
        existing, requested = getattr(old, name), getattr(new, name)
        if existing != requested:
            raise RegistrationConflict(
                worker_id=old.worker_id,
                rank=rank,
                field=name,
                existing=existing,
                requested=requested,
            )
    if rank in old.ranks and not replace:
        raise RegistrationConflict(
            worker_id=old.worker_id, rank=rank, field="rank", existing=rank, requested=rank
        )


def _add_error(spec: StreamSpec, exc: Exception) -> StreamAddError:
    """A feed's own refusal (a duplicate stream: ValueError) as the Subscriber reports one."""
    return StreamAddError(
        worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason=str(exc)
    )
