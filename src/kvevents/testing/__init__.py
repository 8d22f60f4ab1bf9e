"""Fixtures and fault injectors that kvevents' own tests use, for testing integrations.

Submodules by area (import them directly):

- ``kvevents.testing.sockets``: unique endpoints, deadlines, bounded waits;
- ``kvevents.testing.publisher``: ephemeral publisher configs, readiness probes, replay
  helpers, a deterministic queue pause, an out-of-process subscriber;
- ``kvevents.testing.peers``: a scriptable misbehaving publisher (drops, duplicates,
  restarts, 3-frame or trimmed or silent replays), a collecting consumer, and wire fixtures
  shaped like vLLM, SGLang and TensorRT-LLM output;
- ``kvevents.testing.hostile_http``: an HTTP peer that drips, floods or never ends its
  answer (for engine discovery and the TensorRT-LLM poller);
- ``kvevents.testing.engine``: a recording sink and a ground-truth consumer for producers;
- ``kvevents.testing.index``: event builders with properly chained engine hashes;
- ``kvevents.testing.dynamo``: NVIDIA Dynamo's standalone KV indexer as a test peer;
- ``kvevents.testing.service``: our own index service in its own process, the same way;
- ``kvevents.testing.openai_engine``: a fast stand-in OpenAI engine (a ``vllm serve``) that
  streams, drips, hangs, answers 200 MB, closes mid-stream or fails on request, and records
  each request exactly as received;
- ``kvevents.testing.rawhttp``: an HTTP/1.1 client for tests of the bytes on the wire
  (headers as spelled, chunks as framed);
- ``kvevents.testing.route``: a round-robin stand-in planner and ``running_proxy``, the front
  door's proxy in front of given engines;
- ``kvevents.testing.conformance`` (``stage``, ``scenarios``, ``consumers``, ``run``): a
  fault-injection conformance suite for KV event consumers, with adapters for our consumer,
  our HTTP service and NVIDIA Dynamo's indexer.

The simulator's fault injector (a relay that loses a seeded fraction of live messages) is
``kvevents.sim.faults``.
"""
