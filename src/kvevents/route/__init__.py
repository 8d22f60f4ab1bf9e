"""The front door (``kvevents route``): an OpenAI-compatible router in front of the engines.

- Exact prompt tokens, in process: :class:`ModelTokenizer` (a served model's tokenizer and
  chat template), its :class:`Prompt`, and the one ``/tokenize`` fallback
  (:func:`tokenize_request`, :func:`parse_tokenize_reply`).
- The engines and their health: :class:`Engine`, :class:`EnginePool`, :class:`EngineState`.
- The seam to routing: :class:`RouteRequest` in, :class:`Plan` out of a :class:`Planner`,
  :class:`Outcome` reported back.
- The proxy: :class:`RouteApp` (the ASGI app), :func:`serve` (it on a server thread),
  :class:`ProxyOptions`; its errors are :class:`OpenAIError`.

Everything here needs the ``route`` extra and loads on first use. Names are kept one per
line, sorted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.errors import TokenizerNotFound
    from kvevents.route._engines import (
        Engine,
        EngineCounts,
        EnginePool,
        EngineState,
        EngineStats,
    )
    from kvevents.route._metrics import ProxyCounts, ProxyStats
    from kvevents.route._options import ProxyOptions
    from kvevents.route._proxy import RouteApp, serve
    from kvevents.route._replies import OpenAIError
    from kvevents.route._seam import Outcome, OutcomeKind, Plan, Planner, RouteRequest
    from kvevents.route._tokens import (
        EngineOptions,
        ModelTokenizer,
        Prompt,
        TokenizerStats,
        parse_tokenize_reply,
        tokenize_request,
    )
    from kvevents.route._usage import Usage

__all__ = [
    "Engine",
    "EngineCounts",
    "EngineOptions",
    "EnginePool",
    "EngineState",
    "EngineStats",
    "ModelTokenizer",
    "OpenAIError",
    "Outcome",
    "OutcomeKind",
    "Plan",
    "Planner",
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.errors": ("TokenizerNotFound",),
        "kvevents.route._engines": (
            "Engine",
            "EngineCounts",
            "EnginePool",
            "EngineState",
            "EngineStats",
        ),
        "kvevents.route._metrics": ("ProxyCounts", "ProxyStats"),
        "kvevents.route._options": ("ProxyOptions",),
        "kvevents.route._proxy": ("RouteApp", "serve"),
        "kvevents.route._replies": ("OpenAIError",),
        "kvevents.route._seam": ("Outcome", "OutcomeKind", "Plan", "Planner", "RouteRequest"),
        "kvevents.route._tokens": (
            "EngineOptions",
            "ModelTokenizer",
            "Prompt",
            "TokenizerStats",
            "parse_tokenize_reply",
            "tokenize_request",
        ),
        "kvevents.route._usage": ("Usage",),
    },
)
