"""Fit a small transcoder to a model's MLPs — cross-layer (CLT) or a per-layer set (PLT, with or
without a skip path): enough to exercise the pairing check, the anchor and attribution on a
dictionary that really belongs to its model (random weights cannot show any of them works).

Two activations, both trained with Adam (linearly decayed learning rate, clipped gradients) on
normalised reconstruction error:

- ``"relu"`` (default): JumpReLU with every threshold at 0, with an L1 penalty on activations
  weighted by decoder norms. Continuous in its input.
- ``"jumprelu"``: learned per-feature thresholds ``theta`` (``a = z * 1[z > theta]``, as in the
  published CLTs), trained with straight-through estimates of the step's derivative (a
  rectangle kernel of width ``bandwidth``) and an L0 penalty, the Gemma Scope / circuit-tracing
  recipe. A feature that crosses its threshold jumps to at least ``theta``, which is what makes
  such a dictionary fail loudly on an input it was not trained for.

Encoders read ``hook_resid_mid``; a CLT's decoders write every later layer's ``hook_mlp_out``, a
per-layer set's only their own layer's (``kind="per_layer"``), beside a linear ``W_skip`` from
the layer's input with ``skip=True`` (initialised at zero, so the dictionary starts as a plain
PLT); position 0 is left out when it is BOS — when the tokenizer adds one
(:func:`~..prompts.first_position`) — and fitted like any token otherwise.

    clt, stats = fit_clt(model, tokenizer, texts, d_transcoder=256, steps=400)
    plt, stats = fit_clt(model, tokenizer, texts, kind="per_layer", skip=True)
    save_transcoder(plt, "runs/my-skip-plt")   # pyvene_causaltrace.fitting does it all
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from ..defaults import BOS
from ..errors import InputError, MemoryCapError, NonFiniteError
from ..model_guard import measuring
from ..models import model_name as name_of
from ..prompts import first_position
from .hooks import hook_states
from .transcoder import Transcoder

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitStats:
    n_tokens: int
    steps: int
    seconds: float
    final_loss: float
    train_fvu: float


def _kernel(z: torch.Tensor, theta: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """The rectangle kernel that stands in for the step's derivative at ``z = theta``."""
    return ((z - theta).abs() < bandwidth / 2).to(z.dtype) / bandwidth


class _JumpReLU(torch.autograd.Function):
    """``z * 1[z > theta]``; d/d theta = ``-theta * kernel``."""

    @staticmethod
    def forward(ctx, z, theta, bandwidth):
        ctx.save_for_backward(z, theta)
        ctx.bandwidth = bandwidth
        return z * (z > theta)

    @staticmethod
    def backward(ctx, grad):
        z, theta = ctx.saved_tensors
        grad_theta = -theta * _kernel(z, theta, ctx.bandwidth) * grad
        return grad * (z > theta), grad_theta.sum_to_size(theta.shape), None


class _Step(torch.autograd.Function):
    """``1[z > theta]`` for the L0 penalty; d/d theta = ``-kernel``, none to ``z``."""

    @staticmethod
    def forward(ctx, z, theta, bandwidth):
        ctx.save_for_backward(z, theta)
        ctx.bandwidth = bandwidth
        return (z > theta).to(z.dtype)

    @staticmethod
    def backward(ctx, grad):
        z, theta = ctx.saved_tensors
        grad_theta = -_kernel(z, theta, ctx.bandwidth) * grad
        return None, grad_theta.sum_to_size(theta.shape), None


@torch.no_grad()
def collect_pairs(model: nn.Module, tokenizer: Tokenizer, texts: Sequence[str],
                  bos: str = BOS, *, progress: bool = False):
    """``(resid_mid, mlp_out)``, each ``[tokens, L, D]``, over ``texts`` without BOS (position
    0 only when it is BOS under ``bos``, :data:`~..prompts.BOS_MODES`). The model runs in eval
    mode (:func:`~..model_guard.measuring`: dropout would fit a different random function per
    token), its modes restored afterwards; NaN/inf in what it gives is refused."""
    device = next(model.parameters()).device
    start = first_position(tokenizer, bos)
    xs, ys = [], []
    with measuring(model):
        for text in tqdm(texts, desc="collecting activations", unit="text",
                         disable=not progress):
            ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)
            states = hook_states(model, ids, {"x": "hook_resid_mid", "y": "hook_mlp_out"})
            xs.append(states["x"][:, start:].transpose(0, 1))
            ys.append(states["y"][:, start:].transpose(0, 1))
    x, y = torch.cat(xs).float(), torch.cat(ys).float()
    for what, tensor in (("MLP inputs (hook_resid_mid)", x), ("MLP outputs (hook_mlp_out)", y)):
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError(f"the model's {what} on these texts hold NaN/inf: a fit to "
                                 "them would be NaN (check the model's weights and dtype)")
    return x, y


def device_bytes(device: torch.device) -> int:
    """Memory on ``device``: a GPU's, else the machine's physical memory (:mod:`..fitting`
    checks a control group's limit too)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fit_bytes(n_tokens: int, n_layers: int, d_model: int, d_transcoder: int, *,
              kind: str = "cross_layer", skip: bool = False, skip_init: str = "zero",
              batch_size: int = 256) -> int:
    """Bytes a fit holds at its peak, estimated from above: the pairs (twice: the per-text
    pieces and their concatenation), the skip's output on every token, each trained tensor
    four times (weight, gradient, Adam's two moments) and a batch's activations."""
    pairs = 2 * n_tokens * n_layers * d_model * 4
    targets = n_layers * (n_layers + 1) // 2 if kind == "cross_layer" else n_layers
    params = (n_layers * d_transcoder * (d_model + 2) + d_transcoder * targets * d_model
              + n_layers * d_model + (n_layers * d_model * d_model if skip else 0))
    batch = min(batch_size, n_tokens)
    activations = 4 * (6 * batch * n_layers * d_transcoder + 4 * batch * n_layers * d_model)
    closed = n_tokens * n_layers * d_model * 4 + 3 * n_layers * d_model * d_model * 8 \
        if skip and skip_init == "lstsq" else 0
    return 2 * pairs + closed + 16 * params + activations


def check_fit_fits(need: int, have: int, what: str) -> None:
    """Refuse a fit whose estimate ``need`` passes ``have`` bytes, saying what to lower."""
    if need > have:
        raise MemoryCapError(
            f"{what} needs about {_size(need)} of memory at its peak and {_size(have)} is "
            "available: lower features (the transcoder's size), texts or new_tokens (the "
            "activations kept: texts x tokens x layers x d_model, twice)")


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GB" if n >= 2**30 else f"{n / 2**20:,.0f} MB"


def linear_skip(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-4):
    """The least-squares linear map of each layer's input to its output (the MLP's linear
    part), ``(W_skip [L, D_out, D_in], bias [L, D_out])`` with ``y ~ x @ W_skip[l].T + bias``;
    ``ridge`` (relative to the mean input variance) keeps it stable on few tokens."""
    x_mean, y_mean = x.mean(0), y.mean(0)  # [L, D]
    xc, yc = (x - x_mean).double(), (y - y_mean).double()
    gram = torch.einsum("nli,nlj->lij", xc, xc)  # [L, D, D]
    scale = gram.diagonal(dim1=1, dim2=2).mean(1)[:, None, None]
    gram = gram + ridge * scale * torch.eye(x.shape[2], dtype=gram.dtype)
    cross = torch.einsum("nli,nlo->lio", xc, yc)  # [L, D_in, D_out]
    solution = torch.linalg.solve(gram, cross)  # [L, D_in, D_out]
    W_skip = solution.transpose(1, 2).float()
    return W_skip, y_mean - torch.einsum("ld,lod->lo", x_mean, W_skip)


def fit_clt(
    model: nn.Module,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    model_name: str | None = None,
    progress: bool = False,
    **settings,
) -> tuple[Transcoder, FitStats]:
    """Fit a transcoder on the MLPs of ``model`` over ``texts`` (:func:`fit_pairs` takes the
    settings); returns it (float32, in memory) and the fitting statistics."""
    check_settings(**{k: settings[k] for k in ("activation", "kind", "skip") if k in settings})
    start = time.perf_counter()
    x, y = collect_pairs(model, tokenizer, texts, progress=progress)
    transcoder, stats = fit_pairs(x, y, model_name or name_of(model), progress=progress,
                                  **settings)
    return transcoder, replace(stats, seconds=time.perf_counter() - start)


def _check_step(loss: torch.Tensor, step: int, lr: float) -> None:
    """Stop a fit whose loss went NaN/inf (every 20 steps: a check is a device sync)."""
    if not bool(torch.isfinite(loss)):
        raise NonFiniteError(f"the fit diverged: its loss is {loss.item()} at step {step}; "
                             f"lower lr (it was {lr:g})")


def check_settings(activation: str = "relu", kind: str = "cross_layer",
                   skip: bool = False) -> None:
    """Refuse an activation, kind or skip the fit does not know, before any forward."""
    if activation not in ("relu", "jumprelu"):
        raise InputError(f"activation must be 'relu' or 'jumprelu', got {activation!r}")
    if kind not in ("cross_layer", "per_layer"):
        raise InputError(f"kind must be 'cross_layer' or 'per_layer', got {kind!r}")
    if skip and kind != "per_layer":
        raise InputError("a skip path belongs to a per-layer set (kind='per_layer')")


def fit_pairs(
    x: torch.Tensor,
    y: torch.Tensor,
    model_name: str,
    *,
    d_transcoder: int = 128,
    steps: int = 300,
    batch_size: int = 256,
    lr: float = 5e-3,
    l1: float = 1e-3,
    activation: str = "relu",
    l0: float = 1e-3,
    bandwidth: float = 0.05,
    init_threshold: float = 0.05,
    seed: int = 0,
    kind: str = "cross_layer",
    skip: bool = False,
    skip_init: str = "zero",
    progress: bool = False,
    memory_bytes: int | None = None,
) -> tuple[Transcoder, FitStats]:
    """Fit a transcoder (``kind`` ``"cross_layer"`` or ``"per_layer"``, ``skip`` for a per-layer
    skip path) to the pairs ``x`` (``hook_resid_mid``) and ``y`` (``hook_mlp_out``), each
    ``[tokens, L, D]``. ``l1`` weighs the ReLU fit's sparsity penalty; ``l0``, ``bandwidth``
    and ``init_threshold`` are the JumpReLU fit's (in units of the encoder's pre-activation,
    which the initialisation scales to about 1). ``skip_init``: ``"zero"`` starts ``W_skip`` at
    zero and trains it with the features; ``"lstsq"`` sets it (and ``b_dec``) to the
    least-squares linear map first (:func:`linear_skip`) and trains the features on what it
    leaves, ``W_skip`` fixed — the linear part of an MLP in closed form, the features' steps
    spent on the rest. A fit whose estimate (:func:`fit_bytes`) passes ``memory_bytes``
    (default :func:`device_bytes`) is refused before its weights are allocated, and one whose
    loss or weights go NaN/inf stops with :class:`~..errors.NonFiniteError`."""
    check_settings(activation, kind, skip)
    if skip_init not in ("zero", "lstsq"):
        raise InputError(f"skip_init must be 'zero' or 'lstsq', got {skip_init!r}")
    for name, value in (("d_transcoder", d_transcoder), ("steps", steps),
                        ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InputError(f"lr must be a finite positive number, got {lr!r}")
    if not bool(torch.isfinite(x).all() & torch.isfinite(y).all()):
        raise NonFiniteError("the pairs to fit hold NaN/inf: the fit would be NaN")
    start = time.perf_counter()
    n_tokens, n_layers, d_model = x.shape
    check_fit_fits(fit_bytes(n_tokens, n_layers, d_model, d_transcoder, kind=kind, skip=skip,
                             skip_init=skip_init, batch_size=batch_size),
                   device_bytes(x.device) if memory_bytes is None else memory_bytes,
                   f"a fit of {d_transcoder} features per layer on {n_tokens} tokens")
    g = torch.Generator().manual_seed(seed)
    x_scale = x.pow(2).mean((0, 2)).sqrt()[:, None]  # [L, 1] per-layer input scale
    y_var = (y - y.mean(0)).pow(2).mean((0, 2))  # [L] per-layer output variance
    W_enc = nn.Parameter(torch.randn(n_layers, d_transcoder, d_model, generator=g)
                         / d_model**0.5 / x_scale[:, :, None])
    b_enc = nn.Parameter(torch.zeros(n_layers, d_transcoder))
    n_targets = [n_layers - layer if kind == "cross_layer" else 1 for layer in range(n_layers)]
    W_dec = nn.ParameterList(
        nn.Parameter(torch.randn(d_transcoder, n_targets[layer], d_model, generator=g)
                     * 0.1 / d_transcoder**0.5)
        for layer in range(n_layers))
    W_skip = nn.Parameter(torch.zeros(n_layers, d_model, d_model) if skip else torch.zeros(0))
    b_dec = nn.Parameter(y.mean(0).clone())
    closed_form = skip and skip_init == "lstsq"
    linear = None  # with the skip fixed, its output on every token is computed once
    if closed_form:
        W_lin, b_lin = linear_skip(x, y)
        W_skip.data.copy_(W_lin)
        b_dec.data.copy_(b_lin)
        linear = torch.cat([torch.einsum("bld,lod->blo", chunk, W_lin)
                            for chunk in x.split(4096)])
    log_theta = nn.Parameter(torch.full((n_layers, d_transcoder), float(init_threshold)).log())
    params = [W_enc, b_enc, b_dec, *W_dec] + ([log_theta] if activation == "jumprelu" else []) \
        + ([W_skip] if skip and not closed_form else [])
    optimizer = torch.optim.Adam(params, lr=lr)
    # linear decay to zero and clipped gradients: rare tokens with huge MLP outputs otherwise
    # knock the fit off course late in training
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)

    def forward(xb, index=None):
        z = torch.einsum("bld,lfd->blf", xb, W_enc) + b_enc  # [B, L, F]
        if activation == "relu":
            acts = torch.relu(z)
        else:
            acts = _JumpReLU.apply(z, log_theta.exp(), bandwidth)
        recon = b_dec.expand(xb.shape[0], -1, -1).clone()
        if linear is not None:
            recon = recon + (linear if index is None else linear[index])
        elif skip:
            recon = recon + torch.einsum("bld,lod->blo", xb, W_skip)  # x @ W_skip[l].T
        for layer in range(n_layers):
            end = layer + n_targets[layer]
            recon[:, layer:end] += torch.einsum("bf,ftd->btd", acts[:, layer], W_dec[layer])
        return z, acts, recon

    loss = torch.tensor(0.0)
    bar = tqdm(range(steps), desc=f"fitting {kind} transcoder", unit="step", disable=not progress)
    for step in bar:
        index = torch.randint(0, n_tokens, (min(batch_size, n_tokens),), generator=g)
        z, acts, recon = forward(x[index], index)
        mse = ((recon - y[index]).pow(2).mean((0, 2)) / y_var).mean()
        if activation == "relu":
            dec_norm = torch.stack([w.norm(dim=-1).sum(-1) for w in W_dec])  # [L, F]
            loss = mse + l1 * (acts * dec_norm).sum((1, 2)).mean() / (n_layers * d_transcoder)
        else:  # mean L0 per layer and token
            fired = _Step.apply(z, log_theta.exp(), bandwidth)
            loss = mse + l0 * fired.sum(2).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % 20 == 0 or step == steps - 1:
            _check_step(loss, step, lr)
            bar.set_postfix(loss=f"{loss.item():.4f}", fvu=f"{mse.item():.4f}")
            logger.debug("step %d loss %.4f mse %.4f", step, loss.item(), mse.item())
    with torch.no_grad():  # in chunks: [tokens, L, F] at once would be the fit's largest
        errors = torch.zeros(n_layers, dtype=torch.float64)
        for begin in range(0, n_tokens, 4096):
            index = torch.arange(begin, min(n_tokens, begin + 4096))
            _, _, recon = forward(x[index], index)
            errors += (recon - y[index]).double().pow(2).sum((0, 2))
        fvu = float((errors / (y - y.mean(0)).double().pow(2).sum((0, 2))).mean())
        for name, tensor in (("W_enc", W_enc), ("b_enc", b_enc), ("b_dec", b_dec),
                             ("W_dec", torch.cat([w.flatten() for w in W_dec])),
                             ("W_skip", W_skip), ("threshold", log_theta)):
            if not bool(torch.isfinite(tensor).all()):
                raise NonFiniteError(f"the fit diverged: {name} holds NaN/inf after {steps} "
                                     f"steps; lower lr (it was {lr:g})")
    threshold = (log_theta.detach().exp() if activation == "jumprelu"
                 else torch.zeros(n_layers, d_transcoder))
    clt = Transcoder.from_tensors(
        model_name, W_enc.detach(), b_enc.detach(), threshold,
        b_dec.detach(), [w.detach() for w in W_dec],
        list(W_skip.detach()) if skip else None,
        model_kind="cross_layer_transcoder" if kind == "cross_layer" else "transcoder_set")
    stats = FitStats(n_tokens, steps, time.perf_counter() - start, loss.item(), fvu)
    return clt, stats
