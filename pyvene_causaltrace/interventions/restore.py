"""Overwrite a component's output with stored states, by per-row position masks.

Three registered names share one mechanism and differ in what the stored states mean:

- ``clean_restore``: clean-run states (ROME's restoration of one cell);
- ``window_restore``: clean sublayer (MLP or attention) outputs at one layer of a window of
  layers centred ROME's way (:func:`window_layers`); a spec names it once and it expands to one
  instance per layer of the window;
- ``freeze``: the states a component had in another run, typically the corrupted one (ROME's
  severed traces).

Row ``r`` of the batch takes ``states[r]`` (or the single row of ``states``, or
``states[state_rows[r]]`` when ``state_rows`` maps rows to donors, e.g. to their noise seed's
corrupted run) at the positions where ``positions[r]`` is True; a row whose mask is empty is
returned untouched, bit for bit.

    restore = CleanRestore(states=clean_block_out, positions=[[4], [], [8]])
    pv_model = IntervenableModel([{"component": "model.layers[3].output",
                                   "intervention": restore}], model)

Without ``states`` the donor is pyvene's source run (``pv_model(base, sources=[clean])``), as
for ``VanillaIntervention``.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import CausalTraceIntervention, fit_mask, positions_to_mask, rows_for


def window_layers(center: int, window: int, n_layers: int) -> list[int]:
    """ROME's window of ``window`` layers around ``center``, clipped to the model."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if not 0 <= center < n_layers:
        raise ValueError(f"centre layer {center} is outside 0..{n_layers - 1}")
    return list(range(max(0, center - window // 2), min(n_layers, center - (-window // 2))))


class _Overwrite(CausalTraceIntervention):
    tensor_fields = ("states", "positions", "state_rows")
    _config_keys: tuple[str, ...] = ()

    def __init__(self, positions: Any = None, states: torch.Tensor | None = None,
                 state_rows: torch.Tensor | None = None, **kwargs: Any) -> None:
        own = {k: kwargs.pop(k) for k in self._config_keys if k in kwargs}
        if positions is not None:
            own.update(positions=positions, states=states, state_rows=state_rows)
        elif own:
            raise ValueError(f"{self.registered_name} needs positions")
        super().__init__(**own, **kwargs)

    def _setup(self, positions, states=None, state_rows=None, **config: Any) -> None:
        mask = positions_to_mask(positions)
        if states is not None:
            if states.dim() == 2:
                states = states.unsqueeze(0)
            if states.dim() != 3:
                raise ValueError(f"states must be [rows, seq, hidden], got {tuple(states.shape)}")
            states = states.detach().clone()
        if state_rows is not None:
            if states is None:
                raise ValueError("state_rows needs states")
            state_rows = torch.as_tensor(state_rows, dtype=torch.int64).reshape(-1)
            if state_rows.numel() and int(state_rows.max()) >= states.shape[0]:
                raise ValueError(f"state_rows points past the {states.shape[0]} donor rows")
        self._set_tensor("positions", mask)
        self._set_tensor("states", states)
        self._set_tensor("state_rows", state_rows)
        self.is_source_constant = states is not None
        missing = [k for k in self._config_keys if k not in config]
        if missing:
            raise ValueError(f"{self.registered_name} needs {', '.join(missing)}")
        self._config = {k: config[k] for k in self._config_keys}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        donor = self.states if self.states is not None else source
        if donor is None:
            raise ValueError(
                f"{self.registered_name} has no stored states and pyvene passed no source"
            )
        batch, seq_len, hidden = base.shape
        if donor.shape[-2:] != (seq_len, hidden):
            raise ValueError(
                f"{self.registered_name}: donor states are {tuple(donor.shape)}, the component "
                f"output is {tuple(base.shape)}"
            )
        mask = fit_mask(self.positions.to(base.device), batch, seq_len)
        if not bool(mask.any()):
            return base
        if self.state_rows is not None:
            rows_for(batch, self.state_rows.numel(), "state_rows")
            donor = donor.index_select(0, self.state_rows.to(donor.device))
        rows_for(batch, donor.shape[0], "the donor states")
        return torch.where(mask.unsqueeze(-1), donor.to(base.device, base.dtype), base)


class CleanRestore(_Overwrite):
    """Overwrite with clean-run states at per-row positions (see module docstring)."""

    registered_name = "clean_restore"


class WindowRestore(_Overwrite):
    """One layer (``window_layer``) of a sublayer-window restore; ``sublayer`` is ``"mlp"`` or
    ``"attn"``, and ``center``/``window`` record the window the layer belongs to."""

    registered_name = "window_restore"
    _config_keys = ("sublayer", "window_layer", "center", "window")


class Freeze(_Overwrite):
    """Hold a component at the values it had in another run (``run`` names it)."""

    registered_name = "freeze"
    _config_keys = ("run",)
