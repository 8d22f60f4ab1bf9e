"""Run by SGLang's interpreter (``.venv-sglang``): SGLang's publisher-side code, driven over
JSON lines (one request on stdin, one reply on stdout; see sglang_peer.py).

Only SGLang's kv-events module is imported (with the two small modules it needs): the
``sglang`` package's ``__init__`` and ``sglang.srt.utils``' pull in torch and much else, which
that module never uses, so both are entered as bare packages. With ``{"plugins": true}``
SGLang's own ``load_plugins()`` runs first, as in every SGLang process, and finds kvevents'
``sglang.srt.plugins`` entry point.

Requests: ``create`` (``EventPublisherFactory.create(config, attn_dp_rank=rank)``),
``publish`` (SGLang event objects, built by SGLang's classes from the fields given, published
as one ``KVEventBatch`` per list), ``shutdown``, ``quit``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
import types
from importlib.metadata import version
from pathlib import Path
from typing import Any


def _bare_packages() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ImportError("sglang is not installed here")
    root = Path(spec.origin).parent
    for name, path in (("sglang", root), ("sglang.srt.utils", root / "srt" / "utils")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module


_bare_packages()
from sglang.srt.disaggregation import kv_events  # noqa: E402

publishers: dict[int, Any] = {}


def _event(fields: dict[str, Any]) -> Any:
    """One SGLang event from its fields; ``namespace`` hashes the block hashes SGLang's way."""
    fields = dict(fields)
    cls = getattr(kv_events, fields.pop("type"))
    namespace = fields.pop("namespace", None)
    if namespace is not None:
        seed = kv_events.kv_event_namespace_seed(**namespace)
        fields["block_hashes"] = [
            kv_events.namespaced_block_hash(h, namespace_seed=seed) for h in fields["block_hashes"]
        ]
    if fields.get("medium") is not None:
        fields["medium"] = kv_events.StorageMedium(fields["medium"])
    return cls(**fields)


def _create(request: dict[str, Any]) -> dict[str, Any]:
    publisher = kv_events.EventPublisherFactory.create(request["config"], request["rank"])
    publishers[id(publisher)] = publisher
    cls = type(publisher)
    return {
        "id": id(publisher),
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "source": publisher.describe_local_source(request.get("block_size", 4)),
    }


def _publish(request: dict[str, Any]) -> dict[str, Any]:
    publisher = publishers[request["id"]]
    for events in request["batches"]:
        batch = kv_events.KVEventBatch(ts=request["ts"], events=[_event(e) for e in events])
        publisher.publish(batch)
    return {"published": len(request["batches"])}


def _shutdown(request: dict[str, Any]) -> dict[str, Any]:
    publisher = publishers.pop(request["id"])
    publisher.shutdown()
    stats = getattr(publisher, "stats", None)
    if stats is None:
        return {}
    snapshot = stats()
    return {"published": snapshot.publisher.published, "skipped": snapshot.events_skipped}


HANDLERS = {"create": _create, "publish": _publish, "shutdown": _shutdown}


def main() -> None:
    options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if options.get("plugins"):
        from sglang.srt.plugins import load_plugins

        load_plugins()
    registry = sorted(kv_events.EventPublisherFactory._registry)
    print(
        json.dumps({"ready": True, "version": version("sglang"), "registry": registry}), flush=True
    )
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        try:
            reply = HANDLERS[request["op"]](request)
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    for publisher in publishers.values():
        publisher.shutdown()


if __name__ == "__main__":
    main()
