"""dfo's workstation side: inventory, remote targets, launch, watch, batch.

Layering (imports only go downwards): cli -> inventory -> runs/watch/batch -> remote.
decide/ is pure and never imports remote/; nothing here imports torch or trainer/.
"""

__version__ = "0.1.0"
