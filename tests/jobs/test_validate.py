"""Input-file validation: every problem reported with its line number, nothing half-accepted."""

from __future__ import annotations

from sluice.jobs.validate import Invalid, Valid, parse_input


def test_valid_file_keeps_raw_bodies_and_skips_blank_lines():
    content = (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}\n\n'
               b'{"custom_id": "b", "method": "post", "url": "/v1/embeddings", "body": {"input": "y"}}\n')
    parsed = parse_input(content, "/v1/embeddings")
    assert isinstance(parsed, Valid)
    assert [(i.idx, i.custom_id, i.body) for i in parsed.items] == [(0, "a", b'{"input": "x"}'),
                                                                    (1, "b", b'{"input": "y"}')]


def test_kserve_endpoint_accepts_any_model_url():
    line = b'{"custom_id": "a", "method": "POST", "url": "/v2/models/m/versions/2/infer", "body": {}}'
    assert isinstance(parse_input(line, "/v2/infer"), Valid)
    assert isinstance(parse_input(line.replace(b"/infer", b"/ready"), "/v2/infer"), Invalid)


def test_errors_carry_line_numbers():
    content = (b'{"custom_id": "a", "method": "GET", "url": "/v1/embeddings", "body": {}}\n'
               b'{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": [1]}\n'
               b'{"method": "POST", "url": "/v1/embeddings", "body": {}}\n')
    parsed = parse_input(content, "/v1/embeddings")
    assert isinstance(parsed, Invalid)
    assert [(e["line"], e["code"]) for e in parsed.errors] == [(1, "invalid_method"), (2, "invalid_body"),
                                                               (3, "invalid_request")]
    assert isinstance(parse_input(b"\n\n", "/v1/embeddings"), Invalid)
