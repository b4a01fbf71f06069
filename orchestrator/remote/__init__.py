"""How commands reach a machine: one interface (base.Target), three nesting implementations."""

from .base import Command, Result, Stream, Target, render  # noqa: F401
