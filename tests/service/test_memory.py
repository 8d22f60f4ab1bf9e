"""kvevents.service._memory: when the service hands freed memory back to the OS after a burst."""

from __future__ import annotations

import platform

from kvevents.service._memory import IdleTrim, release_free_memory


def test_idle_trim_waits_for_a_quiet_tick_after_enough_batches() -> None:
    """No trim while batches still arrive, nor after a small burst; one per big burst."""
    idle = IdleTrim(min_batches=100)
    assert not idle.due(50)  # busy
    assert not idle.due(50)  # quiet, but too few since the last trim
    assert not idle.due(120)  # busy again
    assert idle.due(120)  # quiet after >= 100: trim
    assert not idle.due(120)  # nothing new since the trim
    assert not idle.due(200)
    assert not idle.due(200)  # quiet, only 80 since the trim
    assert not idle.due(400)
    assert idle.due(400)


def test_release_free_memory_runs_where_glibc_has_it() -> None:
    """With glibc the trim runs and says so; elsewhere it is a no-op returning False."""
    assert release_free_memory() is (platform.libc_ver()[0] == "glibc")
