"""A response's acceptance counts are the engine's own (`AcceptanceStats` per request), the same as
the per-step counts its stream carries."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import chat_body
from .test_sse import sse_events


def test_the_response_reports_the_engines_acceptance_counts(server):
    body = chat_body("write quicksort", max_tokens=40, temperature=0, ignore_eos=True)
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["specdec"]
    _, events = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    steps = [chunk["specdec"] for _, data in events[:-1] if "specdec" in (chunk := json.loads(data))]
    drafted, accepted = sum(s["drafted"] for s in steps), sum(s["accepted"] for s in steps)
    assert plain["drafted"] == drafted > 0 and plain["accepted"] == accepted
    assert plain["acceptance_rate"] == pytest.approx(accepted / drafted)
