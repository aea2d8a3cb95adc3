"""Input factories shared by tests and benchmarks (``inputs``), hypothesis strategies (``strategies``,
needs the ``test`` extra) and tiny random Hugging Face models (``models``)."""
