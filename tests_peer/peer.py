"""The peer: circuit-tracer 0.5 built on the same tiny weights and transcoder files as ours, and
the graph comparison (node spaces mapped, every edge, pruned node sets).

Everything is made in a temporary directory from random init: a tiny Hugging Face model and a
BPE tokenizer saved side by side (what circuit-tracer's nnsight backend loads by path), its
TransformerLens twin (``HookedTransformer`` from the same weights: from a local directory for
Llama, from a hand-made config for Gemma-2, whose TL config exists only for the official
checkpoints), and the transcoder files written by the test suite's own fixture writers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the suite's helpers: _support, the transcoder writers
#: The main suite's tiny models, corpus and prompt.
from _support import models as suite  # noqa: E402, F401 (peer.suite: the conftest, tests)

#: (arch, transcoder kind, backend) -> what the comparison measured, for the summary table.
RESULTS: dict[tuple[str, str, str], dict] = {}
#: circuit-tracer's pruning thresholds (``prune_graph``'s defaults), ours the same.
NODE_THRESHOLD, EDGE_THRESHOLD = 0.8, 0.98
SCAN = "tiny-peer"


# --------------------------------------------------------------------------- tokenizer


def make_tokenizer(corpus: list[str], root: Path):
    """A byte-level BPE tokenizer saved in ``root`` and loaded back from it, whose BOS id is
    not 0 (circuit-tracer picks its BOS with ``next(filter(None, ids))``, which skips id 0)
    and which prepends BOS (our ``attribute`` tokenizes with special tokens, circuit-tracer
    without them and prepends the BOS id itself: both then read the same ids)."""
    # transformers takes seconds to import: only when a test builds a world
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    bos = bpe.token_to_id("<bos>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(root)
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert tokenizer.bos_token_id == bos != 0
    return tokenizer


# ------------------------------------------------------------------- TransformerLens twin


def _gemma2_tl_config(hf_config, model_dir: Path):
    """TransformerLens's Gemma-2 config for a non-official checkpoint, by hand (TL has one
    only for the official names). Local (sliding-window) and global layers follow
    transformers' ``layer_types`` — TL's own Gemma-2 entries list them the other way round."""
    # the peer's stack (circuit-tracer, TransformerLens, nnsight) lives in .venv-peer only:
    # imported where used, so that this module loads (and the suite skips) without it
    from transformer_lens import HookedTransformerConfig

    c = hf_config
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.head_dim, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers,
        n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps, d_vocab=c.vocab_size,
        act_fn=c.hidden_activation, initializer_range=c.initializer_range,
        normalization_type="RMS", positional_embedding_type="rotary",
        rotary_base=c.rope_theta, rotary_dim=c.head_dim,
        use_attn_scale=True, attn_scale=c.query_pre_attn_scalar ** 0.5,
        n_key_value_heads=c.num_key_value_heads, use_local_attn=True,
        window_size=c.sliding_window, attn_types=[kinds[t] for t in c.layer_types],
        attn_scores_soft_cap=c.attn_logit_softcapping,
        output_logits_soft_cap=c.final_logit_softcapping,
        gated_mlp=True, final_rms=True, use_normalization_before_and_after=True,
        original_architecture="Gemma2ForCausalLM", model_name="tiny-gemma2",
        tokenizer_name=str(model_dir), init_weights=False, device="cpu", dtype=torch.float32,
        default_prepend_bos=True)


def tl_replacement_model(model_dir: Path, hf_model, tokenizer, transcoders):
    """circuit-tracer's TransformerLens ``ReplacementModel`` on the weights in ``model_dir``,
    processed as its ``from_pretrained`` does (no folding, no centring)."""
    # the peer's stack: .venv-peer only (see _gemma2_tl_config)
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from transformer_lens import loading_from_pretrained as loading

    name = str(model_dir)
    assert not any(s in name.lower() for s in ("llama", "gemma")), \
        f"TL reads the architecture off a path holding 'llama'/'gemma': {name}"
    if hf_model.config.model_type == "gemma2":
        cfg = _gemma2_tl_config(hf_model.config, model_dir)
    else:
        cfg = loading.get_pretrained_model_config(name, device="cpu", dtype=torch.float32)
    state = loading.get_pretrained_state_dict(name, cfg, hf_model=hf_model, dtype=torch.float32)
    model = TransformerLensReplacementModel(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(state, fold_ln=False, center_writing_weights=False,
                                      center_unembed=False)
    model._configure_replacement_model(transcoders)
    return model.eval()


def nnsight_replacement_model(model_dir: Path, transcoders):
    """circuit-tracer's nnsight ``ReplacementModel``, loading the model and tokenizer from
    ``model_dir`` as it loads a hub checkpoint."""
    from circuit_tracer import ReplacementModel  # the peer's stack: .venv-peer only

    return ReplacementModel.from_pretrained_and_transcoders(
        str(model_dir), transcoders, backend="nnsight", device=torch.device("cpu"),
        dtype=torch.float32)


def replacement_model(backend: str, world, transcoder_path: Path):
    """circuit-tracer's replacement model of ``world`` with the transcoder at
    ``transcoder_path``, on ``backend`` ("transformerlens" or "nnsight"); its transcoders are
    loaded afresh (a replacement model moves and wraps the ones it is given)."""
    transcoders = peer_transcoders(transcoder_path)
    if backend == "transformerlens":
        return tl_replacement_model(world.model_dir, world.model, world.tokenizer, transcoders)
    return nnsight_replacement_model(world.model_dir, transcoders)


# --------------------------------------------------------------------------- transcoders


def peer_transcoders(path: Path):
    """The transcoder at ``path`` as circuit-tracer loads it: a per-layer set through its
    config reader (``load_transcoders`` on the same ``config.yaml`` we read), a CLT directory
    (mntss layout) through ``load_clt`` (its config path only reads the hub)."""
    if path.is_dir():  # the peer's stack below: .venv-peer only
        from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

        meta = yaml.safe_load((path / "config.yaml").read_text())
        return load_clt(str(path), feature_input_hook=meta["feature_input_hook"],
                        feature_output_hook=meta["feature_output_hook"], scan=SCAN,
                        device=torch.device("cpu"), dtype=torch.float32, lazy_decoder=False)
    from circuit_tracer.utils.hf_utils import load_transcoders  # the peer's stack, as above

    config = yaml.safe_load(path.read_text())
    config["scan"] = SCAN
    return load_transcoders(config, device=torch.device("cpu"), dtype=torch.float32,
                            lazy_encoder=False, lazy_decoder=False)


# ----------------------------------------------------------------------------- graphs


@dataclass
class Dense:
    """A graph as circuit-tracer lays it out: nodes (features, errors layer-major, tokens,
    logits), ``adjacency[target, source]``, the feature coordinates ``[n, 3]`` (layer,
    position, id) and activations, the logit token ids and probabilities."""

    adjacency: torch.Tensor
    features: torch.Tensor
    activations: torch.Tensor
    n_layers: int
    n_pos: int
    logit_tokens: list[int]
    logit_probs: torch.Tensor
    input_ids: list[int]

    @property
    def n_features(self) -> int:
        return len(self.features)

    def bos_errors(self) -> torch.Tensor:
        """Node indices of the BOS (position 0) error nodes."""
        return self.n_features + torch.arange(self.n_layers) * self.n_pos


def theirs(graph) -> Dense:
    """circuit-tracer's ``Graph`` (every feature explored: the adjacency is complete)."""
    assert len(graph.selected_features) == len(graph.active_features)
    return Dense(adjacency=graph.adjacency_matrix.double(),
                 features=graph.active_features[graph.selected_features].long(),
                 activations=graph.activation_values[graph.selected_features].double(),
                 n_layers=graph.cfg.n_layers, n_pos=len(graph.input_tokens),
                 logit_tokens=[int(t.vocab_idx) for t in graph.logit_targets],
                 logit_probs=graph.logit_probabilities.double(),
                 input_ids=[int(i) for i in graph.input_tokens])


def ours(graph) -> Dense:
    """Our ``AttributionGraph`` densified in the same node space (steering nodes, of which a
    plain model's graph has none, are refused rather than dropped)."""
    lay = graph.layout
    assert lay.n_steering == 0, "a graph with steering nodes has no circuit-tracer twin"
    n = lay.n_nodes
    adjacency = torch.zeros(n, n, dtype=torch.float64)
    store = graph.rows
    rows = torch.arange(store.n_rows)
    adjacency[store.nodes, :store.n_columns] = store.dense(rows).double()
    tokens, probs = _logits_of(graph)
    return Dense(adjacency=adjacency,
                 features=torch.stack([graph.feature_layer, graph.feature_position,
                                       graph.feature_id], 1).long(),
                 activations=graph.activation.double(), n_layers=graph.n_layers,
                 n_pos=graph.n_pos, logit_tokens=tokens, logit_probs=probs,
                 input_ids=list(graph.input_ids))


def _logits_of(graph) -> tuple[list[int], torch.Tensor]:
    """The logit nodes' token ids and probabilities, in node order."""
    return ([int(t["token"]) for t in graph.targets],
            torch.tensor([float(t["prob"]) for t in graph.targets], dtype=torch.float64))


def relative_edge_difference(a: Dense, b: Dense, skip_columns: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Per row, ``max |a - b|`` over the row's edges relative to the row's largest ``|edge|``
    (the larger of the two graphs'); ``skip_columns`` are left out of both."""
    x, y = a.adjacency.clone(), b.adjacency.clone()
    if skip_columns is not None:
        x[:, skip_columns] = 0
        y[:, skip_columns] = 0
    scale = torch.maximum(x.abs().amax(1), y.abs().amax(1))
    has = scale > 0
    out = torch.zeros(len(x), dtype=torch.float64)
    out[has] = (x - y).abs().amax(1)[has] / scale[has]
    return out


def prune_theirs(graph) -> torch.Tensor:
    """circuit-tracer's pruned node mask at the shared thresholds."""
    from circuit_tracer.graph import prune_graph  # the peer's stack: .venv-peer only

    return prune_graph(graph, NODE_THRESHOLD, EDGE_THRESHOLD).node_mask
