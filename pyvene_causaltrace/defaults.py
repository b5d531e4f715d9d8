"""Defaults shared by the Python API, the command line and specs, in one place (ROME's
protocol where it has one)."""

#: Noise in units of sigma (ROME: three times the std of the subject's input embeddings), for
#: ``Tracer``/``trace``, ``trace --scale``, ``noise_add`` in specs, ``trace_dataset`` and
#: ``dataset --scale`` alike. ``"auto"`` (a sweep) is used only where asked for.
NOISE_SCALE = 3.0
#: Layers in a sublayer window restore (ROME: 10).
WINDOW = 10
#: Noise seeds of one prompt's trace.
TRACE_SEEDS = 10
#: Noise seeds per fact when tracing a dataset.
DATASET_SEEDS = 3
