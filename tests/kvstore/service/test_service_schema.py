"""Schemathesis against the served OpenAPI schema: no input makes the service answer 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_request_gets_a_server_error(server, mode):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    calls = []

    @given(case=schema.as_strategy(mode))
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    def check(case) -> None:
        calls.append(case.call_and_validate(checks=[schemathesis.checks.not_a_server_error]).status_code)

    check()
    assert len(calls) >= 40 and all(status < 500 for status in calls)
