"""`dfo ui`: a local web dashboard of the registry (the runs, a run's curves, a batch's report).

Renders only, as the CLI's commands do: every figure comes from the same store.py, report.py and metrics.py
code as `dfo runs`, `dfo report` and `dfo metrics`, never from a copy of their queries. Remote text (log
lines, crash reasons, names, settings) reaches a page as escaped text only. Its web stack (Starlette, uvicorn,
Jinja2) is the optional extra `dfo[ui]`, imported only by `dfo ui`.
"""
