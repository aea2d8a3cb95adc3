"""Tuning experiments on a GPU, outside the installed package: kernel launch variants (``variants``), decode-step
variants (``fusion``), the host launch path (``host``) and decode steps inside a model (``integration``).  Run
from the repository root, e.g. ``PYTHONPATH=. python -m benchmarks.tuning.fusion --out $OUT``; shapes from
``benchmarks._shapes.SHAPES``."""
