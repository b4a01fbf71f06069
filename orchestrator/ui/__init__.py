"""`dfo ui`: a local web dashboard of the registry (the runs, a run's curves, a batch's report).

Renders only, as the CLI's commands do: every figure comes from the same store.py, report.py and metrics.py
code as `dfo runs`, `dfo report` and `dfo metrics`, never from a copy of their queries. Remote text (log
lines, crash reasons, names, settings) reaches a page as escaped text only. Its web stack (Starlette, uvicorn,
Jinja2) is the optional extra `dfo[ui]`, imported only by `dfo ui`.
"""

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, `[::1]`, `localhost`, or a Host header's `HOST:PORT` / `[V6]:PORT`) names this
    machine's loopback. Not Starlette's TrustedHostMiddleware: before its fix (the ui extra's floor, 0.37, has it
    not) it cut `[::1]:8765` at the first colon, so an IPv6 loopback bind answered every request with 400."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]" if host.count(":") > 1 else host  # a bare IPv6 address, not HOST:PORT
    try:
        name = urlsplit("//" + host).hostname
    except ValueError:
        return False
    if name == "localhost":
        return True
    try:
        return name is not None and ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
