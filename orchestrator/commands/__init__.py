"""One module per noun/verb group; each defines register(app). Commands stay thin."""
