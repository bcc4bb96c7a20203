"""`moesys report`: one self-contained HTML page (charts embedded as PNG, no script, no network) of a training run
directory or of a `moesys infer --json` result. Reading a run needs no torch; drawing needs matplotlib.
"""
