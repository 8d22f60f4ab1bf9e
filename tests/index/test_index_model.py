"""The prefix index against a plain model under random event sequences (hypothesis)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index._prefix import HolderKey, PrefixIndex
from kvevents.testing.index import batch, clear_event, engine_hashes, remove_event, store_event

BS = 2
# Three prompts sharing prefixes, so blocks are shared between prompts and workers.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 9, 9, 9, 9],
    [1, 2, 7, 7, 7, 7, 1, 1],
]
HOLDERS = [("a", "GPU"), ("a", "CPU"), ("b", "GPU")]

op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(HOLDERS),
        st.integers(0, 2),
        st.integers(0, 3),
        st.integers(1, 4),
    ),
    st.tuples(
        st.just("remove"),
        st.sampled_from(HOLDERS),
        st.integers(0, 2),
        st.integers(0, 3),
        st.integers(1, 4),
    ),
    st.tuples(st.just("clear"), st.sampled_from(["a", "b"])),
)


def expected_prefix(held: set[int], prompt: list[int]) -> int:
    depth = 0
    for eh in engine_hashes(prompt, BS):
        if eh not in held:
            break
        depth += 1
    return depth


@settings(max_examples=60, deadline=None)
@given(st.lists(op, max_size=40))
def test_index_equals_the_model(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    """Any mix of stores, duplicate stores, removals and clears leaves exactly the model's state."""
    index = PrefixIndex(BS)
    model: dict[tuple[str, str], Counter[int]] = {h: Counter() for h in HOLDERS}
    for entry in ops:
        if entry[0] == "clear":
            worker = entry[1]
            index.apply(worker, 0, batch(clear_event()))
            for key in HOLDERS:
                if key[0] == worker:
                    model[key].clear()
            continue
        kind, (worker, tier), p, start, length = entry
        prompt, end = PROMPTS[p], min(4, start + length)
        hashes = engine_hashes(prompt, BS)[start:end]
        if kind == "store":
            parent = engine_hashes(prompt, BS)[start - 1] if start else None
            if parent is not None and not any(
                model[k][parent] > 0 for k in HOLDERS if k[0] == worker
            ):
                continue  # the model has no orphans: only stores whose parent is held
            index.apply(
                worker,
                0,
                batch(store_event(prompt, BS, start_block=start, end_block=end, medium=tier)),
            )
            model[(worker, tier)].update(hashes)
        else:
            index.apply(
                worker,
                0,
                batch(remove_event(prompt, BS, start_block=start, end_block=end, medium=tier)),
            )
            for eh in hashes:
                if model[(worker, tier)][eh] > 0:
                    model[(worker, tier)][eh] -= 1
    held = {k: {eh for eh, n in c.items() if n > 0} for k, c in model.items()}
    snapshot = index.snapshot()
    for (worker, tier), hashes in held.items():
        assert snapshot.get(HolderKey(worker, 0, tier), frozenset()) == hashes
    for prompt in PROMPTS:
        got = index.match(prompt).holders
        want = {HolderKey(w, 0, t): expected_prefix(h, prompt) for (w, t), h in held.items()}
        assert got == {k: v for k, v in want.items() if v}
    live = {
        oh for s in index._streams.values() for h in s.holders.values() for oh in h.engine.values()
    }
    assert {h for page in index._pages for h in page} == live


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(6)), st.integers(1, 3))
def test_stores_in_any_order_end_in_place(order: list[int], width: int) -> None:
    """Chained stores delivered in any order (orphans first) end exactly as in order."""
    prompt = list(range(40, 52))  # 6 blocks
    pieces = [(i, min(6, i + width)) for i in range(0, 6, width)]
    index = PrefixIndex(BS)
    for i in order:
        if i < len(pieces):
            start, end = pieces[i]
            index.apply("a", 0, batch(store_event(prompt, BS, start_block=start, end_block=end)))
    assert index.match(prompt).holders == {HolderKey("a", 0, "GPU"): 6}
    stats = index.stats()
    assert (stats.orphans_held, stats.entries, stats.stored_blocks) == (0, 6, 6)
