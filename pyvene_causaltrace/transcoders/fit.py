"""Fit a small transcoder to a model's MLPs — cross-layer (CLT) or a per-layer set (PLT, with or
without a skip path): enough to exercise the pairing check, the anchor and attribution on a
dictionary that really belongs to its model (random weights cannot show any of them works).

Three activations (:data:`FIT_ACTIVATIONS`), trained with Adam on normalised reconstruction
error (docs/transcoders.md, "Fitting"): ``"relu"`` (default; thresholds at 0, an L1 penalty
weighted by decoder norms), ``"jumprelu"`` (learned thresholds ``theta``, straight-through
estimates of the step's derivative — a rectangle of width ``bandwidth`` — and an L0 penalty,
the published CLTs' recipe: a feature that fires jumps to at least ``theta``, so such a
dictionary fails loudly on an input it was not trained for) and ``"relu_topk"`` (each layer's
``k`` largest of ``relu(z)`` a token, sparsify's TopK: the sparsity set, not traded).

Encoders read ``hook_resid_mid``; a CLT's decoders write every later layer's ``hook_mlp_out``, a
per-layer set's (``kind="per_layer"``) their own layer's, beside a linear ``W_skip`` from its
input with ``skip=True``; position 0 is left out only when it is BOS
(:func:`~..prompts.first_position`).

    clt, stats = fit_clt(model, tokenizer, texts, d_transcoder=256, steps=400)
    plt, stats = fit_clt(model, tokenizer, texts, kind="per_layer", skip=True)
    save_transcoder(plt, "runs/my-skip-plt")   # pyvene_causaltrace.fitting does it all
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from ..defaults import BOS
from ..errors import InputError, MemoryCapError, NonFiniteError
from ..memory import device_bytes
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


def fit_bytes(n_tokens: int, n_layers: int, d_model: int, d_transcoder: int, *,
              kind: str = "cross_layer", skip: bool = False, skip_init: str = "zero",
              batch_size: int = 256, element_bytes: int = 4, pieces: bool = True) -> int:
    """Bytes a fit holds at its peak, estimated from above: the pairs (``element_bytes`` a
    number; twice with ``pieces``: :func:`collect_pairs`' per-text pieces and their
    concatenation), what a fixed skip leaves of every output, each trained tensor four times
    (weight, gradient, Adam's two moments) and a batch's activations."""
    pairs = 2 * n_tokens * n_layers * d_model * element_bytes
    targets = n_layers * (n_layers + 1) // 2 if kind == "cross_layer" else n_layers
    params = (n_layers * d_transcoder * (d_model + 2) + d_transcoder * targets * d_model
              + n_layers * d_model + (n_layers * d_model * d_model if skip else 0))
    batch = min(batch_size, n_tokens)
    activations = 4 * (6 * batch * n_layers * d_transcoder + 4 * batch * n_layers * d_model)
    closed = n_tokens * n_layers * d_model * element_bytes \
        + 3 * n_layers * d_model * d_model * 8 if skip and skip_init == "lstsq" else 0
    return (2 if pieces else 1) * pairs + closed + 16 * params + activations


def check_fit_fits(need: int, have: int, what: str) -> None:
    """Refuse a fit whose estimate ``need`` passes ``have`` bytes, saying what to lower."""
    if need > have:
        raise MemoryCapError(
            f"{what} needs about {_size(need)} of memory at its peak and {_size(have)} is "
            "available: lower features (the transcoder's size), texts or new_tokens (the "
            "activations kept: texts x tokens x layers x d_model, twice)")


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GB" if n >= 2**30 else f"{n / 2**20:,.0f} MB"


def linear_skip(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-4, *, chunk: int = 4096):
    """The least-squares linear map of each layer's input to its output (the MLP's linear
    part), ``(W_skip [L, D_out, D_in], bias [L, D_out])`` with ``y ~ x @ W_skip[l].T + bias``;
    ``ridge`` (relative to the mean input variance) keeps it stable on few tokens. The sums
    are taken ``chunk`` tokens at a time (float32 products, float64 totals), so nothing the
    size of ``x`` is copied, and solved by Cholesky (the batched LU solve fails outright,
    "Pivots given to lu_solve", under 2 MKL threads with torch 2.13 on CPU)."""
    n_tokens, n_layers, d_in = x.shape
    x_mean = sum(part.float().sum(0).double() for part in x.split(chunk)) / n_tokens  # [L, D]
    y_mean = sum(part.float().sum(0).double() for part in y.split(chunk)) / n_tokens
    gram = torch.zeros(n_layers, d_in, d_in, dtype=torch.float64, device=x.device)
    cross = torch.zeros(n_layers, d_in, y.shape[2], dtype=torch.float64, device=x.device)
    for xs, ys in zip(x.split(chunk), y.split(chunk), strict=True):
        xc = (xs.float() - x_mean.float()).transpose(0, 1)  # [L, n, D]
        gram += torch.bmm(xc.transpose(1, 2), xc).double()
        cross += torch.bmm(xc.transpose(1, 2), (ys.float() - y_mean.float()).transpose(0, 1))
    scale = gram.diagonal(dim1=1, dim2=2).mean(1)[:, None, None]
    factor, info = torch.linalg.cholesky_ex(gram + ridge * scale * torch.eye(
        d_in, dtype=gram.dtype, device=gram.device))
    if bool((info != 0).any()):
        raise NonFiniteError("the least-squares skip's Gram matrix is not positive definite "
                             "(NaN/inf in the pairs?): no skip can be solved from them")
    solution = torch.cholesky_solve(cross, factor).transpose(1, 2)  # [L, D_out, D_in]
    return solution.float(), (y_mean - torch.einsum("ld,lod->lo", x_mean, solution)).float()


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
    check_settings(**{name: settings[name] for name in ("activation", "kind", "skip", "k")
                      if name in settings}, d_transcoder=settings.get("d_transcoder"))
    start = time.perf_counter()
    x, y = collect_pairs(model, tokenizer, texts, progress=progress)
    transcoder, stats = fit_pairs(x, y, model_name or name_of(model), progress=progress,
                                  **settings)
    return transcoder, replace(stats, seconds=time.perf_counter() - start)


#: The activations a fit trains (module docstring).
FIT_ACTIVATIONS = ("relu", "jumprelu", "relu_topk")


def check_settings(activation: str = "relu", kind: str = "cross_layer", skip: bool = False,
                   k: int | None = None, d_transcoder: int | None = None) -> None:
    """Refuse an activation, kind, skip or ``k`` the fit does not know, before any forward."""
    if activation not in FIT_ACTIVATIONS:
        raise InputError(f"activation must be one of {', '.join(map(repr, FIT_ACTIVATIONS))}, "
                         f"got {activation!r}")
    if activation == "relu_topk":
        most = d_transcoder if isinstance(d_transcoder, int) else None
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (most and k > most):
            raise InputError(f"k (the features relu_topk keeps per layer and token) must be an "
                             f"integer from 1 to {most or 'the features per layer'}, got {k!r}")
    elif k is not None:
        raise InputError(f"k goes with activation 'relu_topk' (a {activation} fit's sparsity "
                         f"comes from its penalty), got k={k!r}")
    if kind not in ("cross_layer", "per_layer"):
        raise InputError(f"kind must be 'cross_layer' or 'per_layer', got {kind!r}")
    if skip and kind != "per_layer":
        raise InputError("a skip path belongs to a per-layer set (kind='per_layer')")


def fast_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (a GPU that has it; a CPU with
    AVX512-BF16 or AMX): there a fit's products in bfloat16 take about half the time, elsewhere
    they are emulated and slower."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported()
                                     or torch.cpu._is_amx_tile_supported())


def _units(x: torch.Tensor, y: torch.Tensor, y_mean: torch.Tensor, g: torch.Generator,
           sample: int = 4096):
    """A fit's units per layer, from ``sample`` tokens: ``x_center`` ``[L, D]`` (the median
    input: robust to the few tokens, such as SmolLM2's first position, whose states are
    hundreds of times the rest), ``x_unit`` ``[L, 1]`` (the median token's root mean square
    about it) and ``y_unit`` ``[L, 1]`` (the root mean square of ``y`` about ``y_mean``)."""
    index = torch.randperm(x.shape[0], generator=g)[:sample]
    xs, ys = x[index].float(), y[index].float()
    x_center = xs.median(0).values
    x_unit = (xs - x_center).pow(2).mean(-1).sqrt().median(0).values.clamp(min=1e-6)[:, None]
    y_unit = (ys - y_mean).pow(2).mean((0, 2)).sqrt().clamp(min=1e-6)[:, None]
    return x_center, x_unit, y_unit


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
    k: int | None = None,
    l0: float = 1e-3,
    bandwidth: float = 0.05,
    init_threshold: float = 0.05,
    seed: int = 0,
    kind: str = "cross_layer",
    skip: bool = False,
    skip_init: str = "zero",
    warmup: int = 0,
    normalize: bool = False,
    bf16: bool = False,
    consume: bool = False,
    progress: bool = False,
    memory_bytes: int | None = None,
) -> tuple[Transcoder, FitStats]:
    """Fit a transcoder (``kind`` ``"cross_layer"`` or ``"per_layer"``, ``skip`` for a per-layer
    skip path) to the pairs ``x`` (``hook_resid_mid``) and ``y`` (``hook_mlp_out``), each
    ``[tokens, L, D]`` (float32, or 16 bits: each batch is read in float32). ``l1`` weighs the
    ReLU fit's sparsity penalty; ``l0``, ``bandwidth`` and ``init_threshold`` are the JumpReLU
    fit's (in units of the encoder's pre-activation, which the initialisation scales to about
    1); ``k`` is ``relu_topk``'s features kept per layer and token. ``skip_init``: ``"zero"``
    starts ``W_skip`` at zero and trains it with the features; ``"lstsq"`` sets it (and
    ``b_dec``) to the least-squares linear map first (:func:`linear_skip`) and trains the
    features on what it leaves, ``W_skip`` fixed — the linear part of an MLP in closed form,
    the features' steps spent on the rest. ``consume``: ``x`` and ``y`` may be overwritten (by
    what the skip leaves, and with ``normalize`` by the pairs in the fit's units). The learning
    rate rises linearly over ``warmup`` steps, then falls linearly to zero. ``normalize``:
    train where each layer's input (less its median token) and target have a typical size of 1
    (:func:`_units`), the decoder starting at zero, folded back at the end — one learning rate
    suits every layer, and large states (a first position hundreds of times the rest) do not
    claim the features. ``bf16``: the steps' products in bfloat16 (:func:`fast_bf16`). A fit
    whose estimate (:func:`fit_bytes`) passes ``memory_bytes`` (default: what this process may
    use, :func:`~..memory.device_bytes`, a control group's limit included) is refused before
    allocating; NaN/inf loss or weights raise :class:`~..errors.NonFiniteError`.
    ``train_fvu`` is scored on up to 8192 tokens, evenly spaced."""
    check_settings(activation, kind, skip, k, d_transcoder)
    if skip_init not in ("zero", "lstsq"):
        raise InputError(f"skip_init must be 'zero' or 'lstsq', got {skip_init!r}")
    for name, value, least in (("d_transcoder", d_transcoder, 1), ("steps", steps, 1),
                               ("batch_size", batch_size, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{name} must be an integer of at least {least}, got {value!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InputError(f"lr must be a finite positive number, got {lr!r}")
    if not all(bool(torch.isfinite(part).all()) for pairs in (x, y) for part in pairs.split(4096)):
        raise NonFiniteError("the pairs to fit hold NaN/inf: the fit would be NaN")
    start = time.perf_counter()
    n_tokens, n_layers, d_model = x.shape
    check_fit_fits(fit_bytes(n_tokens, n_layers, d_model, d_transcoder, kind=kind, skip=skip,
                             skip_init=skip_init, batch_size=batch_size,
                             element_bytes=x.element_size(), pieces=False),
                   device_bytes(x.device) if memory_bytes is None else memory_bytes,
                   f"a fit of {d_transcoder} features per layer on {n_tokens} tokens")
    g = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on every device
    device = x.device  # every tensor of the fit lives with the pairs
    fast = [bf16]  # off for the final score

    def product(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast(a.device.type, dtype=torch.bfloat16, enabled=fast[0]):
            return torch.einsum(equation, a, b).float()

    y_mean = (sum(part.float().sum(0).double() for part in y.split(4096)) / n_tokens).float()
    y_var = (sum((part.float() - y_mean).square_().sum((0, 2)).double() for part in y.split(4096))
             / (n_tokens * d_model)).float()  # [L]: what FVU divides by
    closed_form = skip and skip_init == "lstsq"
    train_skip = skip and not closed_form
    if closed_form:  # the features fit what the fixed skip leaves, its bias the new mean
        W_lin, y_mean = linear_skip(x, y)
        left = y if consume else torch.empty_like(y)
        for xs, ys, out in zip(x.split(4096), y.split(4096), left.split(4096), strict=True):
            out.copy_(ys.float() - torch.einsum("bld,lod->blo", xs.float(), W_lin))
        y = left
    if normalize:
        x_center, x_unit, y_unit = _units(x, y, y_mean, g)
        init_scale, y_base = x_unit, y_mean
    else:
        x_center = y_base = torch.zeros(n_layers, d_model, device=device)
        x_unit = y_unit = torch.ones(n_layers, 1, device=device)
        init_scale = (sum(part.float().square().sum((0, 2)).double() for part in x.split(4096))
                      / (n_tokens * d_model)).sqrt().float()[:, None]
    y_var_fit = y_var / y_unit[:, 0].pow(2)
    ready = consume and normalize  # the pairs put in the fit's units once, in place
    for xs, ys in zip(x.split(4096), y.split(4096), strict=True) if ready else ():
        xs.copy_((xs.float() - x_center) / x_unit)
        ys.copy_((ys.float() - y_base) / y_unit)

    def batch(index):
        """The pairs at ``index`` in the fit's units."""
        if ready:
            return x[index].float(), y[index].float()
        return (x[index].float() - x_center) / x_unit, (y[index].float() - y_base) / y_unit

    W_enc = nn.Parameter(torch.randn(n_layers, d_transcoder, d_model, generator=g).to(device)
                         / d_model**0.5 / init_scale[:, :, None])
    b_enc = nn.Parameter(torch.zeros(n_layers, d_transcoder, device=device))
    per_layer = kind == "per_layer"
    n_targets = [1 if per_layer else n_layers - layer for layer in range(n_layers)]
    dec_scale = 0.0 if normalize else 0.1 / d_transcoder**0.5
    if per_layer:  # one tensor, one batched product
        W_dec_all = nn.Parameter(torch.randn(n_layers, d_transcoder, d_model, generator=g)
                                 .to(device) * dec_scale)
        dec_params = [W_dec_all]
    else:
        dec_params = [nn.Parameter(torch.randn(d_transcoder, n_targets[layer], d_model,
                                               generator=g).to(device) * dec_scale)
                      for layer in range(n_layers)]

    def decoders() -> list[torch.Tensor]:
        return list(W_dec_all[:, :, None]) if per_layer else dec_params

    W_skip = nn.Parameter(torch.zeros((n_layers, d_model, d_model) if skip else 0,
                                      device=device))
    b_dec = nn.Parameter(torch.zeros(n_layers, d_model, device=device) if normalize
                         else y_mean.clone())
    log_theta = nn.Parameter(torch.full((n_layers, d_transcoder), float(init_threshold),
                                        device=device).log())
    params = [W_enc, b_enc, b_dec, *dec_params] \
        + ([log_theta] if activation == "jumprelu" else []) \
        + ([W_skip] if train_skip else [])
    optimizer = torch.optim.Adam(params, lr=lr, fused=True)  # one pass: 8x faster on a CPU
    # warm-up, then linear decay to zero, and clipped gradients: rare tokens with huge MLP
    # outputs otherwise knock the fit off course late in training
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / warmup if warmup else 1.0, 1 - (step - warmup) / max(1, steps - warmup)))
    def forward(xb):
        """``(z, acts, recon)``, float32."""
        z = product("bld,lfd->blf", xb, W_enc) + b_enc  # [B, L, F]
        recon = b_dec.expand(xb.shape[0], -1, -1)
        if train_skip:
            recon = recon + product("bld,lod->blo", xb, W_skip)  # x @ W_skip[l].T
        if activation == "relu_topk":
            values, index = z.topk(k, dim=-1)
            acts = torch.zeros_like(z).scatter(-1, index, torch.relu(values))
        else:
            acts = torch.relu(z) if activation == "relu" else \
                _JumpReLU.apply(z, log_theta.exp(), bandwidth)
        if per_layer:
            return z, acts, recon + product("blf,lfd->bld", acts, W_dec_all)
        recon = recon.clone()
        for layer, w in enumerate(dec_params):
            recon[:, layer:layer + n_targets[layer]] += product("bf,ftd->btd", acts[:, layer], w)
        return z, acts, recon

    loss = torch.tensor(0.0, device=device)
    bar = tqdm(range(steps), desc=f"fitting {kind} transcoder", unit="step", disable=not progress)
    for step in bar:
        xb, yb = batch(torch.randint(0, n_tokens, (min(batch_size, n_tokens),), generator=g))
        z, acts, recon = forward(xb)
        mse = ((recon - yb).pow(2).mean((0, 2)) / y_var_fit).mean()
        if activation == "relu":
            dec_norm = torch.stack([w.norm(dim=-1).sum(-1) for w in decoders()])  # [L, F]
            loss = mse + l1 * (acts * dec_norm).sum((1, 2)).mean() / (n_layers * d_transcoder)
        elif activation == "jumprelu":  # mean L0 per layer and token
            fired = _Step.apply(z, log_theta.exp(), bandwidth)
            loss = mse + l0 * fired.sum(2).mean()
        else:
            loss = mse
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % 20 == 0 or step == steps - 1:
            if not bool(torch.isfinite(loss)):  # every 20 steps: a check is a device sync
                raise NonFiniteError(f"the fit diverged: its loss is {loss.item()} at step "
                                     f"{step}; lower lr (it was {lr:g})")
            bar.set_postfix(loss=f"{loss.item():.4f}", fvu=f"{mse.item():.4f}")
            logger.debug("step %d loss %.4f mse %.4f", step, loss.item(), mse.item())
    fast[0] = False
    with torch.no_grad():  # on up to 8192 tokens, in chunks, in float32
        scored = torch.linspace(0, n_tokens - 1, min(n_tokens, 8192)).long()
        errors = torch.zeros(n_layers, dtype=torch.float64, device=device)
        for part in scored.split(4096):
            xb, yb = batch(part)
            errors += (forward(xb)[2] - yb).double().pow(2).sum((0, 2))
        fvu = float((errors / (y_var_fit.double() * len(scored) * d_model)).mean())
        for name, tensor in (("W_enc", W_enc), ("b_enc", b_enc), ("b_dec", b_dec),
                             ("W_dec", torch.cat([w.flatten() for w in dec_params])),
                             ("W_skip", W_skip), ("threshold", log_theta)):
            if not bool(torch.isfinite(tensor).all()):
                raise NonFiniteError(f"the fit diverged: {name} holds NaN/inf after {steps} "
                                     f"steps; lower lr (it was {lr:g})")
        # back to the model's units
        enc = W_enc / x_unit[:, :, None]
        b_enc_out = b_enc - torch.einsum("lfd,ld->lf", enc, x_center)
        dec = [w * y_unit[layer:layer + n_targets[layer]] for layer, w in enumerate(decoders())]
        b_dec_out = y_base + b_dec * y_unit
        skip_out = W_lin if closed_form else W_skip * y_unit[:, :, None] / x_unit[:, :, None]
        if train_skip:  # the trained skip read x less x_center
            b_dec_out = b_dec_out - torch.einsum("lod,ld->lo", skip_out, x_center)
    threshold = (log_theta.detach().exp() if activation == "jumprelu"
                 else torch.zeros(n_layers, d_transcoder, device=device))
    transcoder = Transcoder.from_tensors(
        model_name, enc.detach(), b_enc_out.detach(), threshold, b_dec_out.detach(),
        [w.detach() for w in dec], list(skip_out.detach()) if skip else None,
        model_kind="cross_layer_transcoder" if kind == "cross_layer" else "transcoder_set",
        device=device, **({"activation": "relu_topk", "k": k} if activation == "relu_topk" else {}))
    stats = FitStats(n_tokens, steps, time.perf_counter() - start, loss.item(), fvu)
    return transcoder, stats
