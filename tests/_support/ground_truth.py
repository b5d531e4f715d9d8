"""A tiny model whose circuit is known because its weights are set by hand (InterpBench-style).

A 2-layer GPT-2 (ReLU MLPs of 16 units, attention writing nothing) and a per-layer transcoder
that *is* its MLPs (encoder = ``c_fc``, decoder = ``c_proj``, threshold 0: the errors are float
rounding). At the prompt's last position feature ``A`` (layer 0, feature 0) fires on the
embedding and writes a direction ``r``; feature ``B`` (layer 1, feature 0) reads ``r`` and fires
only when ``A`` wrote it; ``B`` writes ``g``, the direction the answer's unembedding row reads
(the foil's reads ``g2``). The other 30 features are noise: random encoders (some fire at each
position), small decoders orthogonal to ``r``, ``g``, ``g2``, the ones vector and the last
position's embedding, so they move neither ``B`` nor the logit difference except through the
norms' scale. So the true circuit is ``{A, B}``: with both live, the answer's logit difference
and P(answer) are the model's; with either ablated, ``B`` is off, P(answer) is ~1/vocabulary and
the logit difference is 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyvene_causaltrace.transcoders.transcoder import Transcoder

WIDTH, D_MODEL, VOCAB = 16, 32, 420


@dataclass
class GroundTruth:
    model: torch.nn.Module
    transcoder: Transcoder
    ids: list[int]
    answer: int
    foil: int
    a: tuple[int, int, int]  # (layer, position, feature)
    b: tuple[int, int, int]


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def _ln(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-5)


def build_ground_truth(tokenizer, prompt: str) -> GroundTruth:
    import transformers as tf  # test support: transformers only when the fixture is built

    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=VOCAB, n_embd=D_MODEL, n_layer=2, n_head=4, n_inner=WIDTH,
                           n_positions=64, activation_function="relu", bos_token_id=0,
                           eos_token_id=0, tie_word_embeddings=False, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = tokenizer(prompt)["input_ids"]
    last = len(ids) - 1
    singles = [t for t in range(250, VOCAB) if t not in ids
               and tokenizer(tokenizer.decode([t]), add_special_tokens=False)["input_ids"] == [t]]
    answer, foil = singles[:2]
    g = torch.Generator().manual_seed(1)
    h = model.transformer.h
    with torch.no_grad():
        for block in h:
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
            block.mlp.c_proj.bias.zero_()
        x0 = model.transformer.wte.weight[ids] + model.transformer.wpe.weight[:len(ids)]
        # protected directions: what noise must not write
        basis = torch.linalg.qr(torch.stack([torch.ones(D_MODEL), x0[last],
                                             *torch.randn(3, D_MODEL, generator=g)], 1))[0]
        r, dir_g, dir_g2 = basis[:, 2], basis[:, 3], basis[:, 4]
        project = torch.eye(D_MODEL) - basis @ basis.T

        def noise_mlp(mlp, n_in):
            enc = torch.randn(D_MODEL, WIDTH, generator=g) * 0.6
            mlp.c_fc.weight.copy_(enc)
            mlp.c_fc.bias.copy_(-1.0 - torch.rand(WIDTH, generator=g))
            mlp.c_proj.weight.copy_(torch.randn(WIDTH, D_MODEL, generator=g) @ project * 0.1)

        noise_mlp(h[0].mlp, D_MODEL)
        noise_mlp(h[1].mlp, D_MODEL)
        # A: fires at the last position only, writes r with norm 10
        h0 = _ln(x0)
        a_dir = _unit(h0[last])
        others = (h0[:last] @ a_dir).max()
        h[0].mlp.c_fc.weight[:, 0] = a_dir
        h[0].mlp.c_fc.bias[0] = -(others + h0[last] @ a_dir) / 2
        act_a = float(h0[last] @ a_dir + h[0].mlp.c_fc.bias[0])
        h[0].mlp.c_proj.weight[0] = r * 10 / act_a
        # B: reads what A adds at layer 1's input, fires only with it
        mlp0 = torch.relu(h0 @ h[0].mlp.c_fc.weight + h[0].mlp.c_fc.bias) @ h[0].mlp.c_proj.weight
        x1 = x0 + mlp0
        h1 = _ln(x1)
        without_a = _ln(x1[last] - h[0].mlp.c_proj.weight[0] * act_a)
        b_dir = _unit(h1[last] - without_a)
        off = torch.cat([h1[:last] @ b_dir, (without_a @ b_dir)[None]]).max()
        h[1].mlp.c_fc.weight[:, 0] = b_dir
        h[1].mlp.c_fc.bias[0] = -(off + h1[last] @ b_dir) / 2
        act_b = float(h1[last] @ b_dir + h[1].mlp.c_fc.bias[0])
        h[1].mlp.c_proj.weight[0] = dir_g * 20 / act_b
        model.lm_head.weight[answer] = dir_g * 5
        model.lm_head.weight[foil] = dir_g2 * 5
    transcoder = Transcoder.from_tensors(
        "tiny", W_enc=torch.stack([m.mlp.c_fc.weight.T for m in h]).detach().clone(),
        b_enc=torch.stack([m.mlp.c_fc.bias for m in h]).detach().clone(),
        threshold=torch.zeros(2, WIDTH), b_dec=torch.zeros(2, D_MODEL),
        W_dec=[m.mlp.c_proj.weight.detach().clone()[:, None] for m in h],
        feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
    return GroundTruth(model, transcoder, ids, answer, foil, (0, last, 0), (1, last, 0))
