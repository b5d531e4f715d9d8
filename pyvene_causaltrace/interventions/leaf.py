"""``gradient_leaf``: turn a component's output into an autograd leaf.

The value is unchanged; it is cut from everything upstream and ``requires_grad``, so after a
backward pass ``intervention.leaf.grad`` (or ``torch.autograd.grad(..., intervention.leaf)``)
is the derivative with respect to that state alone. The attribution graph's token nodes are
the embedding outputs made leaves this way.

    leaf = GradientLeaf()
    pv_model = IntervenableModel([{"component": "model.embed_tokens.output",
                                   "intervention": leaf}], model)
    _, out = pv_model(base={"input_ids": ids})
    grad, = torch.autograd.grad(out.logits[0, -1, answer], leaf.leaf)
"""

from __future__ import annotations

from typing import Any

import torch

from .base import CausalTraceIntervention


class GradientLeaf(CausalTraceIntervention):
    """Replace the output by a detached copy that requires grad; keep it as ``self.leaf``."""

    registered_name = "gradient_leaf"
    spec_refusal = ("gradient_leaf is part of the attribution method's local replacement "
                    "model; use an 'attribution' block (or the Python API)")

    def __init__(self, **pyvene_kwargs: Any) -> None:
        super().__init__(**pyvene_kwargs)
        self.__dict__["leaf"] = None  # a run's tensor, not state: stays out of state_dict

    def _setup(self) -> None:
        self._config = {}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        leaf = base.detach().clone().requires_grad_(True)
        self.__dict__["leaf"] = leaf
        # a copy the model reads: an edit of a stream input downstream (a Lorsa encoder on
        # layer 0's residual) writes into what it reads, which a leaf refuses
        return leaf.clone()
