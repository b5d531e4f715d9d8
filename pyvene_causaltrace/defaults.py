"""Defaults shared by the Python API, the command line and specs, in one place (ROME's
protocol where it has one): every parameter, field or flag of one of these settings reads its
default from here (or from ``AttributionSettings``), none writes the value again."""

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

#: How position 0 is treated (:data:`~pyvene_causaltrace.prompts.BOS_MODES`): as BOS only when
#: the tokenizer prepends one. For attribution graphs, steering, transcoder fits and checks.
BOS = "auto"

# Attribution graphs: the defaults of AttributionSettings' fields
# (:class:`~pyvene_causaltrace.attribution.AttributionSettings`, which ``attribute()``, the
# ``attribute`` and ``dataset --graphs`` commands, attribution specs and ``GraphSettings`` read).
# They are written here rather than in ``attribution/`` so that the command line's parser reads
# them without importing torch.

#: The target kind (:data:`~pyvene_causaltrace.attribution.targets.TARGET_KINDS`): the
#: answer's logit minus the mean of the top-``GRAPH_K`` logits.
GRAPH_TARGET = "demeaned"
#: The top-k logits a ``"demeaned"`` target subtracts the mean of.
GRAPH_K = 10
#: Without an answer, circuit-tracer's salient logits: at most this many tokens, until their
#: probabilities reach ``GRAPH_DESIRED_LOGIT_PROB`` (what ``None`` means for either setting).
GRAPH_MAX_N_LOGITS = 10
GRAPH_DESIRED_LOGIT_PROB = 0.95
#: The position-0 (BOS) errors are nodes (``"drop"``: constants, circuit-tracer's convention).
GRAPH_BOS_ERRORS = "keep"
#: Cap, in MB, on the forward graph, the batched gradient rows and the stored rows.
GRAPH_MEMORY_MB = 4096.0
#: Batches of feature rows between two rankings by partial influence.
GRAPH_UPDATE_INTERVAL = 4
#: Attention patterns and norm scales frozen (the local replacement model), rows computed in
#: batches (``loop``: one backward per node, the reference), and every row's closure checked.
GRAPH_FREEZE = True
GRAPH_LOOP = False
GRAPH_CHECK_CLOSURE = True
