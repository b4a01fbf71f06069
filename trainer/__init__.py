"""A DFlash-style block-drafter trainer, the package dfo pushes into containers (`python -m trainer`).

Modules: config (presets, --set), model (target, drafter, loss), data (token sources), compile (strategies),
replica (one replica's step), pipeline (threads topology), procsplit (process topology), metrics (logfmt
lines, W&B), checkpoint, flops (MFU counting), stopsignal (the SIGTERM handler). It must never import `orchestrator`: it runs alone in a
container with torch and nothing else of dfo.
"""
