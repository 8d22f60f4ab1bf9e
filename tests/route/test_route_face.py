"""The route layer's face: the names ``kvevents.route`` exports (the front door); its modules are
private."""

from __future__ import annotations

import kvevents.route

EXPORTED = [
    "Engine",
    "EngineCounts",
    "EngineOptions",
    "EnginePool",
    "EngineSpec",
    "EngineState",
    "EngineStats",
    "FrontDoor",
    "ModelTokenizer",
    "OpenAIError",
    "Outcome",
    "OutcomeKind",
    "Plan",
    "Planner",
    "PlannerOptions",
    "Prompt",
    "ProxyCounts",
    "ProxyOptions",
    "ProxyStats",
    "RouteApp",
    "RouteRequest",
    "TokenizerNotFound",
    "TokenizerStats",
    "Usage",
    "parse_tokenize_reply",
    "serve",
    "tokenize_request",
]


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.route.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.route.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.route, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.route))
