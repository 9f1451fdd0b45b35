"""Durable batch jobs: the OpenAI Files and Batch APIs run on the serving fleet.

    store.py          typed values and the JobStore protocol
    sqlite_store.py   embedded backend (default)      postgres_store.py  shared backend
    validate.py       input file -> items, or line-numbered errors
    executor.py       claims items in leases, runs them through the app, records outcomes
    background.py     background responses (`/v1/responses`, `background: true`): run, leased, taken over
"""
