"""A tenant's batch job under its own limits, on a real server with a tenants file: the job is paced
to the limits (a refusal waits for its Retry-After), not dead-lettered; a model the tenant may not
use fails the file at validation."""

from __future__ import annotations

import openai
import pytest

from sluice.gateway.tenants import hash_key, new_key
from tests.conftest import metric_total, write_emulated_model
from tests.integration.test_batch_api import embedding_lines, jsonl, output_rows, wait_until_final

pytestmark = pytest.mark.slow

KEYS = {name: new_key() for name in ("paced", "narrow", "fenced")}

TENANTS = f"""
[tenants.paced]
api_keys = ["{hash_key(KEYS['paced'])}"]
requests_per_min = 120

[tenants.narrow]
api_keys = ["{hash_key(KEYS['narrow'])}"]
max_concurrent = 2

[tenants.fenced]
api_keys = ["{hash_key(KEYS['fenced'])}"]
models = ["emulated"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server

    folder = tmp_path_factory.mktemp("batch-limits")
    (folder / "tenants.toml").write_text(TENANTS)
    repo = write_emulated_model(folder / "models", "emulated", alpha_ms=5.0, beta_ms=0.0)
    write_emulated_model(repo, "slowish", alpha_ms=50.0, beta_ms=0.0)
    started = start_server(repo, folder, "--tenants", str(folder / "tenants.toml"), "--data-dir", str(folder / "data"))
    yield started
    started.stop()


def _run(server, tenant: str, num_lines: int, model: str = "emulated"):
    lines = embedding_lines(num_lines)
    for line in lines:
        line["body"]["model"] = model
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60) as client:
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        done = wait_until_final(client, batch.id, timeout_s=120)
        return done, output_rows(client, done.output_file_id), output_rows(client, done.error_file_id)


def test_a_requests_per_minute_limit_paces_the_job(server):
    """120 requests a minute: the first 120 lines go at once, the other 10 as the bucket refills."""
    done, ok, errors = _run(server, "paced", 130)
    assert done.status == "completed" and errors == []
    # the limit did refuse items (which then waited), it was not bypassed
    assert metric_total(server, "sluice_tenant_rejected_total", tenant="paced", reason="requests") >= 1
    assert (done.request_counts.completed, done.request_counts.failed) == (130, 0)
    assert [r["custom_id"] for r in ok] == [f"req-{i}" for i in range(130)]


def test_a_concurrency_limit_paces_the_job(server):
    """Two at a time on a 50 ms device: 100 lines take at least 2.5 s, longer than five quick retries."""
    done, ok, errors = _run(server, "narrow", 100, model="slowish")
    assert done.status == "completed" and errors == []
    assert metric_total(server, "sluice_tenant_rejected_total", tenant="narrow", reason="concurrency") >= 1
    assert (done.request_counts.completed, done.request_counts.failed) == (100, 0) and len(ok) == 100



def test_a_model_the_tenant_may_not_use_fails_the_file_at_validation(server):
    done, ok, errors = _run(server, "fenced", 3, model="slowish")
    assert done.status == "failed" and done.request_counts.total == 0 and ok == errors == []
    assert [(e.line, e.code) for e in done.errors.data] == [(1, "model_not_found"), (2, "model_not_found"),
                                                            (3, "model_not_found")]
    assert "does not exist or you do not have access to it" in done.errors.data[0].message
