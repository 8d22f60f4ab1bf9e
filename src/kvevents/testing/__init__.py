"""Fixtures and fault injectors that kvevents' own tests use, for testing integrations.

Submodules by area (import them directly): ``kvevents.testing.sockets`` (ports, socket
cleanup, readiness handshakes) and more as the system grows.
"""
