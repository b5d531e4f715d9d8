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
#: The noise unit: ROME's, the std of the subject's input embeddings
#: (:data:`~pyvene_causaltrace.interventions.noise.SIGMA_METHODS`, or a number).
SIGMA = "rome"
#: The noise's distribution (:data:`~pyvene_causaltrace.interventions.noise.DISTRIBUTIONS`).
DISTRIBUTION = "gaussian"
#: The scales (in sigma) a ``scale="auto"`` sweep tries, smallest first.
NOISE_SCALES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
#: Memory budget (MB) of one batch of restored rows: ``Tracer``/``trace``, ``trace_dataset``
#: and the ``trace``, ``run`` and ``dataset`` commands (``--budget-mb``).
TRACE_MEMORY_MB = 2048.0
#: The trace engine's exact shortcuts: start each row at its restored position (earlier
#: positions' keys and values from the corrupted run) and at its restored layer (the blocks
#: below replaying the corrupted run's outputs). Turned off only to compare.
REUSE_PREFIX = True
REPLAY_LAYERS = True

# Dataset runs (:class:`~pyvene_causaltrace.dataset.DatasetSettings`).

#: The trace kinds of a dataset run.
DATASET_KINDS = ("residual", "mlp", "attn")
#: Which facts are traced: ``"argmax"``, those whose clean prediction is the target
#: (``"none"``: every well-formed one; a built-in task may default to it).
KNOWN = "argmax"
#: Bootstrap resamples of the aggregate's intervals.
N_BOOT = 1000
#: With ``--graphs``: each fact's graph is kept under ``graphs/`` only when asked for.
DATASET_SAVE_GRAPHS = False

# Reading a graph and checking it against a trace.

#: Pruning: the nodes carrying this share of the cumulative influence, then the edges carrying
#: ``EDGE_THRESHOLD`` of the cumulative edge score (circuit-tracer's values).
NODE_THRESHOLD = 0.8
EDGE_THRESHOLD = 0.98
#: ``graph.json`` holds at most this many links, those of largest edge score: the viewers slow
#: down long before a million links, and ~60 bytes each keep a capped export near 25 MB.
MAX_LINKS = 400_000
#: The cross-check (:class:`~pyvene_causaltrace.crosscheck.CrossCheckSettings`): the trace
#: kinds compared, layers one MLP restore spans (one MLP sublayer, as a graph cell; not ROME's
#: ``WINDOW``), the cells of its top-k overlap, the features it patches, where the patches are
#: measured (the spliced model and the local replacement model) and whether heads are compared.
CROSS_CHECK_KINDS = ("residual", "mlp")
CROSS_CHECK_WINDOW = 1
CROSS_CHECK_TOP_K = 10
CROSS_CHECK_FEATURES = 20
CROSS_CHECK_MODES = ("spliced", "replacement")
CROSS_CHECK_HEADS = False
#: Steering (:class:`~pyvene_causaltrace.steering.SteeringSettings`): the greedy tokens
#: generated (0: the logits only), the transcoder's errors held at the clean run's, the
#: attention patterns live, the top tokens shown per run.
STEER_MAX_NEW_TOKENS = 0
STEER_HOLD_ERRORS = True
STEER_FREEZE_ATTENTION = False
STEER_TOP_K = 10

#: Where the command line loads the model and the transcoder (``--device``): ``"cpu"``,
#: ``"cuda"``, ``"cuda:N"``, ``"mps"`` or ``"auto"`` (CUDA when available, else the CPU).
DEVICE = "cpu"

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
#: The dtype the replacement forward and backward run in (``None``: the model's; ``"bfloat16"``
#: on a float32 model: under autocast), and whether two runs must be bit-identical (torch's
#: deterministic algorithms on, docs/attribution.md, "Precision and determinism").
GRAPH_DTYPE = None
GRAPH_DETERMINISTIC = False

#: Faithfulness curves (``faithfulness``, ``evaluate``): MIB's circuit sizes, in percent of the
#: ranked items (its ``percentages`` 0.001 ... 1 as fractions); what is ranked (``"nodes"``:
#: feature nodes, ``"edges"``), by what (``"influence"`` or ``"direct"``), what the features
#: outside the circuit are set to (MIB's default: the counterfactual prompt's values), whether
#: the error nodes are held at the clean run's or ablated like the features, the metric, the
#: random rankings drawn for the floor, and the circuits per forward.
FAITH_SIZES = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
FAITH_LEVEL = "nodes"
FAITH_RANK_BY = "influence"
FAITH_ABLATION = "counterfactual"
FAITH_ERRORS = "held"
FAITH_METRIC = "logit_diff"
FAITH_DRAWS = 5
FAITH_SEED = 0
FAITH_BATCH = 16
#: Feature-budget curves (``budget_curve``, ``evaluate --budget``): the numbers K of
#: transcoder features kept live (PIE's; the curve adds every active feature, "all").
FAITH_BUDGETS = (50, 100, 200, 400, 800)

#: A trace's faithfulness (``trace_faithfulness``, ``trace --faithfulness``, ``dataset
#: --faithfulness``): circuit sizes in percent of the trace's cells (CPR and CMD integrate over
#: these), the small absolute numbers of top cells reported beside them, the random rankings
#: drawn for the floor (seeded), the rows (seed x circuit) per forward, and which cells are
#: ranked (``"all"``, or ``"subject"``: those at the noised subject's positions).
TRACE_FAITH_CELLS = "all"
TRACE_FAITH_SIZES = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
TRACE_FAITH_TOP = (1, 2, 5, 10, 20)
TRACE_FAITH_DRAWS = 5
TRACE_FAITH_SEED = 0
TRACE_FAITH_ROWS = 64
#: The same, by field, for the torch-free parser's flags.
TRACE_FAITH = {"sizes": TRACE_FAITH_SIZES, "top": TRACE_FAITH_TOP, "draws": TRACE_FAITH_DRAWS,
               "seed": TRACE_FAITH_SEED, "rows": TRACE_FAITH_ROWS, "cells": TRACE_FAITH_CELLS}
