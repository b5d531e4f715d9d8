"""The cross-layer transcoder: JumpReLU encoders per layer, decoders into every later layer.

Shapes (``L`` layers, ``F`` features per layer, ``D`` = d_model):

- ``W_enc[l]`` ``[F, D]``, ``b_enc[l]`` ``[F]``, ``threshold[l]`` ``[F]``, ``b_dec[l]`` ``[D]``;
- ``W_dec[l]`` ``[F, L - l, D]``: feature ``f`` born at layer ``l`` writes ``W_dec[l][f, t - l]``
  into target layer ``t >= l``.

Encode: ``a = z * 1[z > threshold]`` with ``z = x @ W_enc[l].T + b_enc[l]`` (JumpReLU), ``x`` =
``hook_resid_mid`` at layer ``l``. Reconstruct:
``mlp_out_t ~= b_dec[t] + sum_{l <= t} sum_f a[l, f] * W_dec[l][f, t - l]``. Features at position 0
(BOS) are zeroed: no dictionary is trained on the attention sink there.

The decoder is usually far larger than everything else (18 GB for the 1B model's CLT): with
``lazy_decoder`` it stays memory-mapped on disk and only the rows of features that fired are read.

    clt = CrossLayerTranscoder.from_pretrained("path/or/hub-id")
    acts = clt.encode_all(resid_mid)          # [L, P, F], position 0 zeroed
    recon = clt.reconstruct(acts)             # [L, P, D]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import CLTConfig


class CrossLayerTranscoder(nn.Module):
    """A CLT held as buffers (encoder side) and per-layer decoder tensors (resident or mmapped).

    Build one with :meth:`from_pretrained`, :func:`~pyvene_causaltrace.clt.loaders.load_from_disk`
    or :meth:`from_tensors`; write it with :meth:`save_model`.
    """

    def __init__(
        self,
        cfg: CLTConfig,
        *,
        b_enc: torch.Tensor,
        threshold: torch.Tensor,
        b_dec: torch.Tensor,
        W_enc: torch.Tensor | None,
        W_dec: list[torch.Tensor],
        encoder_loader: Callable[[int], torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        source: str | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device_ = torch.device(device)
        self.source = source
        self.register_buffer("b_enc", b_enc.to(self.device_, dtype))
        self.register_buffer("threshold", threshold.to(self.device_, dtype))
        self.register_buffer("b_dec", b_dec.to(self.device_, dtype))
        self.W_enc = None if W_enc is None else W_enc.to(self.device_, dtype)
        self._encoder_loader = encoder_loader
        if W_enc is None and encoder_loader is None:
            raise ValueError("a streamed encoder needs an encoder_loader")
        # Decoders are not buffers: a mmapped one must not be copied by .to() or state_dict().
        self.W_dec = W_dec
        self._handles: list = []  # safe_open handles that keep mmapped decoders valid

    # ----------------------------------------------------------------------- building
    @classmethod
    def from_tensors(cls, model_name: str, W_enc, b_enc, threshold, b_dec, W_dec,
                     **kwargs) -> CrossLayerTranscoder:
        """From stacked ``W_enc [L, F, D]``, ``b_enc``/``threshold [L, F]``, ``b_dec [L, D]`` and
        a list of ``W_dec[l] [F, L - l, D]``."""
        n_layers, d_transcoder, d_model = W_enc.shape
        cfg = CLTConfig(model_name, n_layers, d_model, d_transcoder,
                        disk_dtype=str(W_enc.dtype).removeprefix("torch."))
        return cls(cfg, b_enc=b_enc, threshold=threshold, b_dec=b_dec, W_enc=W_enc,
                   W_dec=list(W_dec), **kwargs)

    @classmethod
    def from_pretrained(cls, repo_id_or_dir: str, **kwargs) -> CrossLayerTranscoder:
        """Load from a local directory or a Hugging Face hub id (see
        :func:`~pyvene_causaltrace.clt.loaders.from_pretrained`)."""
        from .loaders import from_pretrained

        return from_pretrained(repo_id_or_dir, **kwargs)

    @classmethod
    def load_from_disk(cls, path: str, **kwargs) -> CrossLayerTranscoder:
        """Load a local directory (see :func:`~pyvene_causaltrace.clt.loaders.load_from_disk`)."""
        from .loaders import load_from_disk

        return load_from_disk(path, **kwargs)

    def save_model(self, path: str) -> None:
        """Write the mntss layout (see :func:`~pyvene_causaltrace.clt.loaders.save_model`)."""
        from .loaders import save_model

        save_model(self, path)

    # ------------------------------------------------------------------------ encoder
    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    def encoder_weight(self, layer: int) -> torch.Tensor:
        """``W_enc[layer]`` ``[F, D]`` in the compute dtype (read from disk if streamed)."""
        if self.W_enc is not None:
            return self.W_enc[layer]
        return self._encoder_loader(layer).to(self.device_, self.dtype)

    def encode(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """JumpReLU features ``[..., F]`` of ``hook_resid_mid`` values ``x [..., D]``."""
        z = x.to(self.dtype) @ self.encoder_weight(layer).T + self.b_enc[layer]
        return z * (z > self.threshold[layer])

    def encode_all(self, resid_mid: torch.Tensor, zero_bos: bool = True) -> torch.Tensor:
        """``[L, P, D]`` -> ``[L, P, F]``; position 0 zeroed unless ``zero_bos=False``."""
        acts = torch.stack([self.encode(resid_mid[layer], layer)
                            for layer in range(self.n_layers)])
        if zero_bos:
            acts[:, 0] = 0
        return acts

    # ------------------------------------------------------------------------ decoder
    def decoder_rows(self, layer: int, feature_ids: torch.Tensor) -> torch.Tensor:
        """``W_dec[layer][feature_ids]`` ``[n, L - layer, D]``, gathered (only these rows are
        read from a mmapped decoder) and converted to the compute dtype."""
        ids = feature_ids.to(self.W_dec[layer].device)
        return self.W_dec[layer].index_select(0, ids).to(self.device_, self.dtype)

    def reconstruct(self, acts: torch.Tensor) -> torch.Tensor:
        """``[L, P, F]`` activations -> ``[L, P, D]`` reconstructed MLP outputs (with b_dec)."""
        n_layers, n_pos, _ = acts.shape
        recon = self.b_dec[:, None, :].expand(n_layers, n_pos, -1).clone()
        for layer in range(n_layers):
            pos, fid = acts[layer].nonzero(as_tuple=True)
            if pos.numel() == 0:
                continue
            unique, inverse = fid.unique(return_inverse=True)  # read each row once
            rows = self.decoder_rows(layer, unique)[inverse]  # [n, L - layer, D]
            contrib = rows * acts[layer, pos, fid][:, None, None]
            flat = torch.zeros((n_layers - layer) * n_pos, self.cfg.d_model,
                               dtype=self.dtype, device=self.device_)
            targets = torch.arange(n_layers - layer, device=self.device_)
            index = (targets[None, :] * n_pos + pos[:, None]).reshape(-1)
            flat.index_add_(0, index, contrib.reshape(-1, self.cfg.d_model))
            recon[layer:] += flat.reshape(n_layers - layer, n_pos, self.cfg.d_model)
        return recon

    def __deepcopy__(self, memo) -> CrossLayerTranscoder:
        # Read-only and possibly gigabytes backed by open file maps: copies share it (pyvene
        # deep-copies its config, which holds interventions that hold the CLT).
        return self

    def extra_repr(self) -> str:
        c = self.cfg
        lazy = "mmapped" if self._handles else "resident"
        return (f"{c.model_name}: {c.n_layers} layers x {c.d_transcoder} features, "
                f"d_model={c.d_model}, decoder {lazy}, dtype={self.dtype}")


class CLTMismatchError(ValueError):
    """A CLT's shape does not fit the model it is used with."""


def check_fits(clt: CrossLayerTranscoder, model: nn.Module) -> None:
    """Raise :class:`CLTMismatchError` unless ``clt`` has the model's layer count and width;
    warn when the names differ (the shapes may agree by accident: run the pairing check)."""
    import warnings

    from ..models import get_adapter

    adapter = get_adapter(model)
    n_layers, d_model = adapter.n_layers(model), adapter.hidden_size(model)
    if (clt.cfg.n_layers, clt.cfg.d_model) != (n_layers, d_model):
        raise CLTMismatchError(
            f"the CLT ({clt.cfg.model_name}) has {clt.cfg.n_layers} layers x d_model "
            f"{clt.cfg.d_model}; the model has {n_layers} layers x {d_model}")
    name = getattr(model, "pvct_source", None) or getattr(model.config, "_name_or_path", "")
    if clt.cfg.model_name and name and clt.cfg.model_name not in (name, name.split("/")[-1]):
        warnings.warn(f"the CLT was made for {clt.cfg.model_name!r}, the model is {name!r}; "
                      "run check_pairing before trusting it", stacklevel=2)
