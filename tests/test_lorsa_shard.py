"""A Lorsa sharded by OV head (issue 56 item 1), in one process: ``load_lorsa(...,
shard=(rank, world))`` and ``Lorsa.shard`` hold each rank's contiguous OV heads (uneven: 45
over 2 and 3 ranks; rank 0 of 2 cuts a QK group), read only their rows of ``W_V``, ``W_O`` and
``b_V`` from the file (the QK side and ``b_D`` whole), encode them as the whole does where no
ranking is needed (relu) and decode their part; a TopK shard, and attribution through any shard,
refuse outside a distributed run. Across ranks: tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from _support.reads import record_reads
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa

from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.replacement import replacement_forward
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_from_disk
from pyvene_causaltrace.transcoders.lorsa import head_range, load_lorsa, save_lorsa

#: OV heads (32 x 1.40625), QK heads (groups of 15).
HEADS, QK = 45, 3
HEAD_TENSORS = ("W_V", "W_O", "b_V")


def _write(tmp_path, act_fn: str = "topk", layers=(0,)):
    for layer in layers:
        cfg = peer_config(layer=layer, n_qk=QK, expansion=HEADS / 32, act_fn=act_fn,
                          use_post_qk_ln=True, normalization_type="RMS")
        write_peer_lorsa(tmp_path / "lorsa" / f"L{layer}", cfg, peer_tensors(cfg, seed=layer),
                         (2.5, 0.7))
    return tmp_path / "lorsa"


@pytest.fixture
def recorded(monkeypatch) -> list:
    return record_reads(monkeypatch)


def test_head_range_covers_every_head_once_and_refuses_bad_splits():
    for world in (1, 2, 3, 7):
        ranges = [head_range(HEADS, rank, world) for rank in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == HEADS
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert head_range(HEADS, 0, 2) == (0, 23)  # 23 % 15: rank 0 ends inside QK group 1
    with pytest.raises(InputError, match="cannot share n_ov_heads=45 OV heads"):
        head_range(HEADS, 0, 46)
    with pytest.raises(InputError, match="rank must be in 0..1"):
        head_range(HEADS, 2, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_shards_are_slices_of_the_whole_read_lazily_or_cut_after(tmp_path, world):
    """A sharded load and the shard of a loaded whole hold the same tensors: the whole's
    OV-head rows [lo, hi), its QK side and b_D unchanged."""
    root = _write(tmp_path)
    whole = load_lorsa(root)[0]
    for rank in range(world):
        lazy = load_lorsa(root, shard=(rank, world))
        assert lazy.sharded and not lazy.layers[0]._loaded  # nothing read yet
        cut = whole.shard(rank, world)
        lo, hi = head_range(HEADS, rank, world)
        for part in (lazy[0], cut):
            assert part.heads == (lo, hi) and part.n_local == hi - lo
            assert part.head_offset == lo and part.cfg == whole.cfg
            for name, tensor in whole.tensors().items():
                want = tensor[lo:hi] if name in HEAD_TENSORS else tensor
                assert torch.equal(part.tensors()[name], want), name
            assert part.resident_bytes() < whole.resident_bytes()


def test_a_sharded_load_reads_only_its_heads_rows(tmp_path, recorded):
    """Every read of W_V, W_O and b_V holds the rank's 15 heads (of 45); nothing is read
    before first use. The control: the whole load reads all 45 rows of each."""
    root = _write(tmp_path)
    part = load_lorsa(root, shard=(1, 3))
    assert recorded == []  # the headers only
    part[0].load()
    per_head = [(name, shape) for name, shape in recorded if name in HEAD_TENSORS]
    assert sorted(name for name, _ in per_head) == sorted(HEAD_TENSORS)
    assert all(shape[0] == 15 for _, shape in per_head), per_head
    assert ("W_Q", (QK, 32, 8)) in recorded  # the QK side whole
    recorded.clear()
    load_lorsa(root)[0]
    assert sorted(shape[0] for name, shape in recorded if name in HEAD_TENSORS) == [HEADS] * 3


def test_a_relu_shard_encodes_its_heads_alone_and_decodes_its_part(tmp_path):
    """Without TopK a shard's heads need no other rank: its encode is the whole's columns,
    and the partial decodes summed plus b_D are the whole's output. A whole decode of a shard
    is refused (the control: one shard's part is not the output)."""
    root = _write(tmp_path, act_fn="relu")
    whole = load_lorsa(root)[0]
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    acts = whole.encode(x)
    for world in (2, 3):  # 2: rank 0 ends inside a QK group, rank 1 starts inside it
        total = torch.zeros(2, 9, 32)
        for rank in range(world):
            part = load_lorsa(root, shard=(rank, world))[0]
            mine = part.encode(x)
            torch.testing.assert_close(mine, acts[..., slice(*part.heads)], rtol=1e-6,
                                       atol=1e-6)
            total += part.decode(mine, partial=True)
            with pytest.raises(InputError, match="its decode is partial"):
                part(x)
            with pytest.raises(InputError, match=f"holds {part.n_local}"):
                part.decode(acts, partial=True)
        torch.testing.assert_close(total + whole.b_D, whole.decode(acts), rtol=1e-5, atol=1e-6)
    assert (part.decode(mine, partial=True) + whole.b_D - whole.decode(acts)).abs().max() > 1e-3


def test_a_topk_shard_alone_refuses_to_encode_and_shards_are_not_saved_or_resharded(tmp_path):
    root = _write(tmp_path)
    whole = load_lorsa(root)[0]
    x = torch.randn(1, 6, 32)
    assert (whole.encode(x) != 0).any()
    part = whole.shard(0, 2)
    alone = ("one rank's shard of its OV heads .*its TopK ranks them against the other ranks' "
             "heads: alone it cannot tell which 5 are kept; encode it under torchrun")
    with pytest.raises(InputError, match=alone):
        part.encode(x)
    with pytest.raises(InputError, match="already a shard"):
        part.shard(0, 2)
    with pytest.raises(InputError, match="save the whole Lorsa"):
        save_lorsa(part, tmp_path / "out")
    with pytest.raises(InputError, match=r"shard=1 \(int\): expected a pair"):
        load_lorsa(root, shard=1)


def test_attribution_through_a_lorsa_shard_outside_a_distributed_run_is_refused(tmp_path,
                                                                                tokenizer):
    """attribute with a sharded Lorsa (beside a whole transcoder) in one process says why;
    the replacement forward refuses a Lorsa split otherwise than the transcoder. The control:
    the whole Lorsa attributes."""
    root = _write(tmp_path, layers=(0, 2))
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 47,
                                                                             threshold=0.1))))
    graph = attribute(model, tokenizer, clt, PROMPT, attention=load_lorsa(root),
                      max_feature_nodes=4)
    assert graph.lorsa_layers == [0, 2]
    part = load_lorsa(root, shard=(0, 2))
    with pytest.raises(InputError, match="one rank's shard of its OV heads"):
        attribute(model, tokenizer, clt, PROMPT, attention=part, max_feature_nodes=4)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with pytest.raises(InputError, match="split over ranks as the transcoder is"):
        replacement_forward(bind(model), clt, ids, lorsa=part)
    with pytest.raises(InputError, match="split over ranks as the transcoder is"):
        replacement_forward(bind(model), clt.shard(0, 2), ids, lorsa=load_lorsa(root))
