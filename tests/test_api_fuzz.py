"""Schemathesis campaign against a real ``ckptd`` API server (uvicorn over loopback, real catalog).

Every operation of the served OpenAPI document gets schema-driven requests -- valid ones
(positive) and ones that break the schema (negative) -- sent with an admin token, a report token
and no token at all, on SQLite and on PostgreSQL. Every answer must be 2xx/4xx, never 5xx, and
conform to the document: a documented status code, content type, headers and body schema;
schema-invalid input refused; schema-valid input not refused as malformed.

Bounded so the suite stays fast: the cases are generated once (derandomized, a fixed number per
operation, mode and variant) and replayed against each server and token. ``CKPTD_FUZZ_EXAMPLES=N``
runs a longer campaign with the same checks.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402

from ckptd.settings import Settings  # noqa: E402
from tests.api_helpers import Server  # noqa: E402
from tests.daemon_helpers import save_shard, write_tp_strategy  # noqa: E402

TOKENS = {"fuzz-read-token": "read", "fuzz-report-token": "report", "fuzz-admin-token": "admin"}
EXAMPLES = int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "6"))

#: Refusals the schema cannot express, answered 400 on purpose (schemathesis calls them "rejected
#: positive data"): a conversion's strategy file must lie inside the checkpoint root, its source
#: step must be restorable -- facts of the server's disk and catalog, not of the request's shape;
#: the resume route's ``split`` matches its pattern yet asks for more ranks than any job has
#: (tp x dp x pp over the world bound: a product, which a schema cannot express).
SEMANTIC_400 = {("POST", "/v1/runs/{run}/conversions"), ("GET", "/v1/runs/{run}/resume")}

_CASES: list = []  # generated once per session, replayed against every server and token


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fuzz_server(request, tmp_path_factory, ms):
    from ckptd.catalog.db import make_engine, upgrade
    from tests.conftest import fresh_pg_database

    base = tmp_path_factory.mktemp("fuzz")
    root = base / "root"
    write_tp_strategy(root / "run1")
    for step in (100, 200):
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)
    if request.param == "sqlite":
        url, drop = f"sqlite:///{base / 'catalog.db'}", (lambda: None)
    else:
        url, drop = fresh_pg_database()
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    settings = Settings(root=root, db=url, settle_seconds=0.1, rescan_interval=3600, tokens=TOKENS)
    try:
        with Server(settings) as srv:
            srv.settle()
            yield srv
    finally:
        drop()


def _generate(url: str, examples: int) -> list:
    """Cases for every operation, positive and negative; for operations on a run also with the
    run that exists (and one of its steps), so requests get past the 404 into the catalog."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    cases: list = []
    for result in schema.get_all_operations():
        op = result.ok()
        variants = [{}]
        if "{run}" in op.path:
            variants.append({"path_parameters": {"run": "run1"}})
            if "{step}" in op.path:
                variants.append({"path_parameters": {"run": "run1", "step": 100}})
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for fixed in variants:
                strategy = op.as_strategy(generation_mode=mode, **fixed)

                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def collect(case) -> None:
                    cases.append(case)

                try:
                    collect()
                except Unsatisfiable:  # nothing to negate (an operation without parameters)
                    pass
    return cases


def _replay(server, cases: list, token: str | None) -> tuple[Counter, dict[str, str]]:
    """Send every case; count answers and collect distinct problems (never raises on a finding)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    stats: Counter = Counter()
    problems: dict[str, str] = {}
    with requests.Session() as session:
        for case in cases:
            op = case.operation
            response = case.call(base_url=server.url, headers=headers, session=session, timeout=30)
            stats["requests"] += 1
            stats[f"{response.status_code // 100}xx"] += 1
            try:
                case.validate_response(response, headers=headers)
                continue
            except FailureGroup as group:
                found = [f"{type(f).__name__}: {f.title}" for f in group.exceptions
                         if not (type(f).__name__ == "RejectedPositiveData" and response.status_code == 400
                                 and (op.method.upper(), op.path) in SEMANTIC_400)]
            if not found:
                stats["semantic_400"] += 1
                continue
            if response.status_code >= 500:
                stats["5xx"] += 1
            stats["violations"] += len(found)
            for kind in found:
                problems.setdefault(f"{op.method.upper()} {op.path}: {kind}",
                                    f"{case.as_curl_command(headers={})}\n-> {response.status_code} {response.text[:400]}")
    return stats, problems


# bounded: admin on both catalogs, the report scope on PostgreSQL, no token on SQLite
_COMBOS = [("sqlite", "fuzz-admin-token"), ("sqlite", None), ("postgresql", "fuzz-admin-token"),
           ("postgresql", "fuzz-report-token")]


@pytest.mark.parametrize(("fuzz_server", "token"), _COMBOS, indirect=["fuzz_server"],
                         ids=["sqlite-admin", "sqlite-no-token", "postgresql-admin", "postgresql-report"])
def test_schemathesis_campaign_finds_no_5xx_and_no_schema_violation(fuzz_server, token, request):
    catalog = request.node.callspec.params["fuzz_server"]
    started = time.monotonic()
    if not _CASES:
        _CASES.extend(_generate(fuzz_server.url, EXAMPLES))
    generated = time.monotonic()
    stats, problems = _replay(fuzz_server, _CASES, token)
    who = {"fuzz-admin-token": "admin token", "fuzz-report-token": "report token", None: "no token"}[token]
    summary = (f"{catalog}, {who}: {stats['requests']} requests "
               f"({generated - started:.1f}s generating, {time.monotonic() - generated:.1f}s sending): "
               f"{stats['5xx']} 5xx, {stats['violations']} schema violations ({len(problems)} distinct), "
               f"statuses {dict((k, v) for k, v in stats.items() if k.endswith('xx'))}")
    print(summary)
    assert stats["requests"] > 100
    assert not problems, summary + "\n\n" + "\n\n".join(f"{k}\n{v}" for k, v in sorted(problems.items()))
