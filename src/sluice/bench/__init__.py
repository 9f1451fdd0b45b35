"""`sluice bench`: an open-loop load generator for sluice (or any KServe v2 / OpenAI server).

    cli.py        the click command; parses flags, imports the rest lazily
    runner.py     one workload, one run per offered rate; writes the outputs
    loadgen.py    Poisson schedule and the sender, on uvloop
    http_client.py  the sender's lean keep-alive HTTP/1.1 client (httptools, callbacks, no task per request)
    workloads.py  pre-encoded request bodies for each endpoint
    promstats.py  server-side mean batch size and busy ratio from two /metrics scrapes
    stats.py      pure summaries: percentiles, per-rate results, SLO goodput
    report.py     summary tables, the JSON document, the PNG plot
    selftest.py   the generator's own ceiling, against nullserver.py in a child process
"""
