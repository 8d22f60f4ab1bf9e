"""Fixtures of the real-engine tests (test_vllm*.py)."""

from __future__ import annotations

import os

import pytest
from vllm_peer import find_vllm_python, vllm_version


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """vLLM's interpreter; skip without it, or fail when KVEVENTS_REQUIRE_VLLM is set."""
    version, reason = vllm_version()
    if reason is not None and os.environ.get("KVEVENTS_REQUIRE_VLLM"):
        pytest.fail(f"KVEVENTS_REQUIRE_VLLM is set but {reason}")
    if reason is not None:
        pytest.skip(reason)
    python = find_vllm_python()
    assert python is not None and version is not None
    return python
