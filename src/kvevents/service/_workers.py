"""The rules a registration must keep, as pure functions of registrations.

:class:`~kvevents.service.IndexService` applies them before it changes anything: a rank
registered on its own must fit its worker's other ranks (:func:`check_fits`), one model may
keep one block size (:func:`check_model_size`), and a stream the feed refuses is reported as
the Subscriber reports one (:func:`add_error`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.errors import RegistrationConflict, StreamAddError
from kvevents.events import StreamKey
from kvevents.service._feed import WorkerRegistration
from kvevents.subscribe import StreamSpec

__all__ = ["add_error", "check_fits", "check_model_size", "model_targets"]


def check_fits(old: WorkerRegistration, new: WorkerRegistration, rank: int, replace: bool) -> None:
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


def check_model_size(workers: Iterable[WorkerRegistration], reg: WorkerRegistration) -> None:
    """RegistrationConflict when another worker of ``reg``'s model has another block size."""
    for other in workers:
        if other.model_name == reg.model_name and other.block_size != reg.block_size:
            raise RegistrationConflict(
                worker_id=reg.worker_id,
                rank=reg.ranks[0],
                field="block_size",
                existing=other.block_size,
                requested=reg.block_size,
            )


def model_targets(workers: Iterable[WorkerRegistration], model_name: str) -> list[StreamKey]:
    """The (worker, rank) targets serving ``model_name``: those registered for it, and those
    registered with no model name, which serve any."""
    return [
        (reg.worker_id, rank)
        for reg in workers
        if reg.model_name in (model_name, None)
        for rank in reg.ranks
    ]


def add_error(spec: StreamSpec, exc: Exception) -> StreamAddError:
    """A feed's refusal of ``spec`` as a StreamAddError (a duplicate stream is a ValueError)."""
    if isinstance(exc, StreamAddError):
        return exc
    return StreamAddError(
        worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason=str(exc)
    )
