"""A database outage in the log (`jobs.outage`): one warning as it begins, a reminder at most every
`remind_s` while it lasts, one info line when it ends; a bug keeps its traceback. Driven by a
virtual clock."""

from __future__ import annotations

import logging

import psycopg
import pytest

from sluice.errors import Unavailable
from sluice.jobs.outage import OutageLog


def _unavailable() -> Unavailable:
    try:
        try:
            raise psycopg.OperationalError("connection failed: Connection refused\n\tIs the server running?")
        except psycopg.OperationalError as exc:
            raise Unavailable("the batch job store is unavailable; try again shortly") from exc
    except Unavailable as exc:
        return exc


def test_an_outage_is_said_when_it_begins_every_remind_s_while_it_lasts_and_when_it_ends(
        caplog: pytest.LogCaptureFixture):
    now = [0.0]
    outage = OutageLog(logging.getLogger("sluice.jobs"), "batch jobs", remind_s=60.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="sluice.jobs")
    outage.succeeded()  # no outage: nothing to say
    for _ in range(150):  # a round a second for 150 s
        outage.failed(_unavailable(), "step failed")
        now[0] += 1.0
    outage.succeeded()
    outage.succeeded()
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("WARNING", "batch jobs: the job store cannot be reached, retrying: the batch job store is unavailable; "
                    "try again shortly (OperationalError: connection failed: Connection refused)"),
        ("WARNING", "batch jobs: the job store still cannot be reached after 60 s: the batch job store is "
                    "unavailable; try again shortly (OperationalError: connection failed: Connection refused)"),
        ("WARNING", "batch jobs: the job store still cannot be reached after 120 s: the batch job store is "
                    "unavailable; try again shortly (OperationalError: connection failed: Connection refused)"),
        ("INFO", "batch jobs: the job store is reachable again after 150 s"),
    ]
    assert not any(r.exc_info for r in caplog.records)


def test_a_failure_that_is_no_outage_is_a_bug_logged_with_its_traceback_each_time(
        caplog: pytest.LogCaptureFixture):
    outage = OutageLog(logging.getLogger("sluice.jobs"), "batch jobs", clock=lambda: 0.0)
    caplog.set_level(logging.INFO, logger="sluice.jobs")
    for _ in range(2):
        try:
            raise KeyError("x")
        except KeyError as exc:
            outage.failed(exc, "step failed")
    outage.succeeded()  # no outage began
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("ERROR", "step failed")] * 2
    assert all(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
