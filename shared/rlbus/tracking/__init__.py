"""Experiment trackers: the metrics rows of a run written to TensorBoard, Weights & Biases or
MLflow as well as to ``metrics.jsonl``, chosen by name (``RLBUS_TRACKING``).

:mod:`.base` holds the interface every sink implements and the figures' shapes, one module
per sink holds its writer (its library imported only when the sink opens), and
:mod:`.composite` opens the sinks a setting names and fans every call out to them.
"""
