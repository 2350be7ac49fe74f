"""rlbus from other training frameworks, each an optional extra that imports its framework
only when used: :mod:`.trl` (``pip install 'rlbus[trl]'``).

An integration is built on :mod:`rlbus.client` alone; no tier imports one.
"""
