"""Files a reader must refuse, or read as their own project does, rather than return wrong
numbers without an error (audit of the layout readers): sae-lens input normalisation,
circuit-tracer configs contradicting their files, GemmaScope's ``relu(z) * 1[z > threshold]``
with negative thresholds."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import yaml
from transcoder_fixtures import (
    dense_reference,
    random_set,
    write_circuit_tracer,
    write_gemmascope,
    write_sae_lens,
)

from pyvene_causaltrace.transcoders import TranscoderFormatError, load_transcoder

L, D, F = 2, 8, 12


def _set_cfg(root, **fields):
    for sub in root.iterdir():
        cfg = json.loads((sub / "cfg.json").read_text())
        (sub / "cfg.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("mode", ["layer_norm", "constant_norm_rescale",
                                  "expected_average_only_in"])
def test_sae_lens_input_normalisation_is_refused_not_ignored(tmp_path, mode):
    from sae_lens import SAE

    tensors = random_set(L, D, F)
    root = write_sae_lens(tmp_path / "sl", tensors)
    _set_cfg(root, normalize_activations=mode)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0)) * 3 + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sae = SAE.load_from_disk(str(root / "transcoder_layer_0"))
    raw, _ = dense_reference({**tensors, "layers": tensors["layers"][:1]}, x[None])
    if mode != "expected_average_only_in":  # sae-lens itself rescales the input at run time:
        assert not torch.allclose(sae.encode(x)[1:].double(), raw[0, 1:], atol=1e-4)
    # (expected_average_only_in: the weights want x times a factor the files do not hold)
    with pytest.raises(TranscoderFormatError, match="normalize_activations"):
        load_transcoder(root, format="sae_lens")
