"""Schemathesis against the served OpenAPI schema: no input makes the service answer 5xx."""

from __future__ import annotations

import re

import httpx
import pytest
import schemathesis
from schemathesis import checks
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


def operations(schema: dict):
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def test_openapi_agrees_with_the_server_about_tokens_and_statuses(server, guarded):
    plain = httpx.get(f"{server.url}/openapi.json").json()
    assert "securitySchemes" not in plain["components"]  # no token configured: no auth declared
    for path, method, operation in operations(plain):
        assert "security" not in operation and "401" not in operation["responses"], (method, path)
        assert "422" not in operation["responses"]  # validation errors are answered 400
    token = httpx.get(f"{guarded.url}/openapi.json").json()
    assert token["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, method, operation in operations(token):
        needs = path == "/metrics" or path.startswith("/v1/")
        assert ("401" in operation["responses"]) == needs and ("security" in operation) == needs, (method, path)
        url = guarded.url + path.replace("{namespace}", "ns").replace("{key:path}", "k").replace("{key}", "k")
        status = httpx.request(method.upper(), url).status_code  # no token
        assert (status == 401) == needs and str(status) in operation["responses"], (method, path, status)
    params = {p["name"]: p["schema"] for p in token["paths"]["/v1/namespaces/{namespace}/keys"]["get"]["parameters"]}
    assert params["prefix"]["pattern"] == params["after"]["pattern"] == "^[A-Za-z0-9_.~:@+=/-]*$"
    assert params["prefix"]["maxLength"] == 400


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_the_prefix_lookup_schema_states_what_the_server_accepts(server, mode):
    """Every body the schema allows is answered 200; every body it forbids is refused with a 4xx."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operation = schema["/v1/prefix/{namespace}/lookup"]["POST"]
    agrees = checks.positive_data_acceptance if mode is GenerationMode.POSITIVE else checks.negative_data_rejection
    statuses = []

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    def check(case) -> None:
        statuses.append(case.call_and_validate(checks=[checks.not_a_server_error, agrees]).status_code)

    check()
    namespace = next(p for p in operation.definition.raw["parameters"] if p["name"] == "namespace")["schema"]
    named = [bool(re.search(namespace["pattern"], name)) for name in (".", "..", ".a", "a.b")]
    assert named == [False, False, True, True]  # "." and ".." never reach the route: URLs drop them
    assert len(statuses) >= 100
    if mode is GenerationMode.POSITIVE:
        assert set(statuses) == {200}
    else:
        assert all(400 <= status < 500 for status in statuses), sorted(set(statuses))
