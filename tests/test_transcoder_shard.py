"""Transcoders sharded by feature (issue 41): each rank holds features ``feature_range(F, rank,
world)`` of every layer, read lazily from the files (never a whole W_enc or W_dec), and the shards
together are exactly the whole: their encoder rows, biases, thresholds and decoder rows are the
whole's slices, their features the whole's, their partial reconstructions plus one b_dec and skip
the whole's reconstruction."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml
from _support.reads import RecordedSlice, Recorder, record_reads
from clt_fixtures import random_clt_tensors, write_clt
from safetensors.torch import load_file, save_file
from test_transcoder_layouts_new import gs2_tensors, write_gs2_clt
from transcoder_fixtures import (
    bytedance_tensors,
    random_set,
    write_bytedance,
    write_circuit_tracer,
    write_gemmascope,
    write_sparsify,
)

from pyvene_causaltrace.errors import InputError, TranscoderFormatError
from pyvene_causaltrace.transcoders import Transcoder, feature_range, load_transcoder
from pyvene_causaltrace.transcoders.formats import circuit_tracer, common, sparsify

L, D, F = 3, 32, 47  # 47 features: uneven over 2 and 3 ranks
WORLDS = (1, 2, 3)


# ------------------------------------------------------------------------------ fixtures
def _mntss(tmp_path: Path, activation: str) -> Path:
    path = write_clt(tmp_path / f"clt_{activation}", random_clt_tensors(L, D, F, seed=4))
    if activation == "relu":  # the mntss ReLU CLT: no thresholds anywhere
        for layer in range(L):
            file = path / f"W_enc_{layer}.safetensors"
            tensors = load_file(str(file))
            del tensors[f"threshold_{layer}"]
            save_file(tensors, str(file))
    return path


def _circuit_tracer(tmp_path: Path, transposed: bool = False) -> Path:
    """A per-layer JumpReLU set with skip; ``transposed`` stores W_enc and W_dec as [D, F]."""
    tensors = random_set(L, D, F, seed=5, skip=True)
    config = write_circuit_tracer(tmp_path / f"ct_{transposed}", tensors,
                                  transposed_decoder=transposed)
    if transposed:
        for layer in range(L):
            file = config.parent / f"layer_{layer}.safetensors"
            stored = load_file(str(file))
            stored["W_enc"] = stored["W_enc"].T.contiguous()
            save_file(stored, str(file))
    return config


class Source(NamedTuple):
    path: Path
    mappable: bool  # whether a lazy decoder stays memory-mapped ([D, F] files are transposed)


@pytest.fixture(params=["mntss_jumprelu", "mntss_relu", "circuit_tracer_skip",
                        "circuit_tracer_transposed"])
def source(request, tmp_path) -> Source:
    name = request.param
    if name.startswith("mntss"):
        return Source(_mntss(tmp_path, name.removeprefix("mntss_")), True)
    transposed = name.endswith("transposed")
    return Source(_circuit_tracer(tmp_path, transposed=transposed), not transposed)


class Guard(Recorder):
    """A safetensors handle that refuses to read a whole ``W_enc``/``W_dec`` and records the
    shape of every slice read of one."""

    def get_tensor(self, name: str):
        if name.startswith(("W_enc", "W_dec")):
            raise AssertionError(f"whole {name} read")
        return self.handle.get_tensor(name)

    def get_slice(self, name: str):
        return GuardedSlice(self.handle.get_slice(name), name, self.reads)


class GuardedSlice(RecordedSlice):
    """A slice that records reads of ``W_enc``/``W_dec`` only."""

    def __getitem__(self, key):
        if not self.name.startswith(("W_enc", "W_dec")):
            return self.part[key]
        return super().__getitem__(key)


@pytest.fixture
def guarded(monkeypatch) -> list:
    """Every safetensors file opened through the guard; returns the list of slice reads."""
    reads: list = []
    real = common.safe_open
    monkeypatch.setattr(common, "safe_open", lambda *a, **k: Guard(real(*a, **k), reads))
    return reads


def _inputs(seed: int = 0, n_pos: int = 6) -> torch.Tensor:
    return torch.randn(L, n_pos, D, generator=torch.Generator().manual_seed(seed))


def _skips(tc: Transcoder, inputs: torch.Tensor) -> torch.Tensor:
    return torch.stack([tc.skip(inputs[layer], layer) for layer in range(L)])


# ------------------------------------------------------------------------------ ranges
def test_feature_range_covers_every_feature_once_uneven_first():
    for d_transcoder in (1, 7, 47, 48):
        for world in range(1, min(d_transcoder, 6) + 1):
            ranges = [feature_range(d_transcoder, rank, world) for rank in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == d_transcoder
            assert all(a[1] == b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True))
            sizes = [hi - lo for lo, hi in ranges]
            extra = d_transcoder % world
            assert sizes == [d_transcoder // world + (rank < extra) for rank in range(world)]
    assert [feature_range(47, r, 3) for r in range(3)] == [(0, 16), (16, 32), (32, 47)]


@pytest.mark.parametrize("args, match", [
    ((47, 0, 0), "world must be >= 1, got world=0"),
    ((47, 3, 3), r"rank must be in 0..2 for world=3, got rank=3"),
    ((47, -1, 2), "got rank=-1"),
    ((4, 0, 5), "world=5 ranks cannot share d_transcoder=4"),
    ((47, 0.0, 2), r"rank=0.0 \(float\): expected an int"),
])
def test_feature_range_refuses_bad_values(args, match):
    with pytest.raises(InputError, match=match):
        feature_range(*args)


# ------------------------------------------------------------------------------ shards = whole
@pytest.mark.parametrize("lazy_decoder", [True, False])
def test_lazy_shards_are_exact_slices_of_the_whole(source, lazy_decoder):
    whole = load_transcoder(source.path, lazy_decoder=False)
    inputs = _inputs()
    acts = whole.encode_all(inputs)
    recon = whole.reconstruct(acts, inputs)
    assert acts[:, 1:].count_nonzero() > 0  # some features fire: the comparison means something
    for world in WORLDS:
        covered, total = [], torch.zeros_like(recon)
        for rank in range(world):
            part = load_transcoder(source.path, shard=(rank, world),
                                   lazy_decoder=lazy_decoder)
            lo, hi = part.features
            assert (lo, hi) == feature_range(F, rank, world)
            assert (part.n_local, part.feature_offset) == (hi - lo, lo)
            assert part.cfg == whole.cfg and part.cfg.d_transcoder == F
            assert bool(part._handles) == (lazy_decoder and source.mappable)
            covered += range(lo, hi)
            assert torch.equal(part.W_enc, whole.W_enc[:, lo:hi])
            assert torch.equal(part.b_enc, whole.b_enc[:, lo:hi])
            assert torch.equal(part.threshold, whole.threshold[:, lo:hi])
            assert torch.equal(part.b_dec, whole.b_dec)
            for layer in range(L):
                assert torch.equal(part.W_dec[layer], whole.W_dec[layer][lo:hi])
                ids = torch.tensor([0, hi - lo - 1])
                assert torch.equal(part.decoder_rows(layer, ids),
                                   whole.decoder_rows(layer, ids + lo))
                if whole.W_skip is not None:
                    assert torch.equal(part.W_skip[layer], whole.W_skip[layer])
            local = part.encode_all(inputs)
            assert local.shape == (L, inputs.shape[1], hi - lo)
            assert torch.equal(local, acts[..., lo:hi])
            for layer in range(L):
                assert torch.equal(part.encode(inputs[layer], layer),
                                   whole.encode(inputs[layer], layer)[:, lo:hi])
            total += part.reconstruct(local, partial=True)
        assert sorted(covered) == list(range(F))
        total += whole.b_dec[:, None] + _skips(whole, inputs)
        torch.testing.assert_close(total, recon, atol=1e-5, rtol=0)


def test_shard_of_a_loaded_transcoder_equals_the_lazy_shard(source):
    inputs = _inputs(1)
    for lazy_decoder in (True, False):
        whole = load_transcoder(source.path, lazy_decoder=lazy_decoder)
        mapped = lazy_decoder and source.mappable
        assert bool(whole._handles) == mapped
        for rank in range(3):
            part = whole.shard(rank, 3)
            loaded = load_transcoder(source.path, shard=(rank, 3), lazy_decoder=lazy_decoder)
            assert part.features == loaded.features
            assert torch.equal(part.encode_all(inputs), loaded.encode_all(inputs))
            for layer in range(L):
                assert torch.equal(part.W_dec[layer], loaded.W_dec[layer])
                same = part.W_dec[layer].untyped_storage().data_ptr() \
                    == whole.W_dec[layer].untyped_storage().data_ptr()
                assert same == mapped  # a mapped decoder stays a view; a resident one is copied
            assert part._handles == whole._handles


def test_a_shard_reconstructs_only_its_part_and_says_so(tmp_path):
    """A shard's whole reconstruction would be wrong (a part of every layer's features): it
    is refused; its partial one plus b_dec and the skip is the whole's for its features."""
    config = _circuit_tracer(tmp_path)
    whole = load_transcoder(config)
    part = whole.shard(1, 2)
    inputs = _inputs(2)
    acts = part.encode_all(inputs)
    with pytest.raises(InputError, match="partial=True"):
        part.reconstruct(acts, inputs)
    padded = torch.zeros(*acts.shape[:2], whole.n_local)
    padded[..., part.feature_offset:part.feature_offset + part.n_local] = acts
    torch.testing.assert_close(
        part.reconstruct(acts, partial=True) + whole.b_dec[:, None] + _skips(whole, inputs),
        whole.reconstruct(padded, inputs), atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="acts hold 47 features per layer; this transcoder "
                                         "shard holds 23"):
        part.reconstruct(whole.encode_all(inputs), partial=True)


# ------------------------------------------------------------------------------ lazy reads
@pytest.mark.parametrize("lazy_decoder", [True, False])
def test_a_sharded_load_never_reads_a_whole_encoder_or_decoder(source, guarded, monkeypatch,
                                                              lazy_decoder):
    if not lazy_decoder:  # resident slices come through get_slice, never a map of the decoder
        def no_map(*args, **kwargs):
            raise AssertionError("the decoder was mapped for a resident sharded load")
        monkeypatch.setattr(common, "mmap_tensor", no_map)  # mntss's decoders (read_decoders)
        monkeypatch.setattr(circuit_tracer, "mmap_tensor", no_map)
    part = load_transcoder(source.path, shard=(1, 3), lazy_decoder=lazy_decoder)
    n_local = part.n_local
    kinds = {name[:5] for name, _ in guarded}  # W_enc_{l} / W_dec_{l} / W_enc / W_dec
    assert kinds == ({"W_enc"} if lazy_decoder and source.mappable else {"W_enc", "W_dec"})
    assert all(n_local in shape and F not in shape for _, shape in guarded), guarded
    assert all(w.shape[0] == n_local for w in part.W_dec)
    assert bool(part._handles) == (lazy_decoder and source.mappable)


def test_control_an_unsharded_load_trips_the_guard(source, guarded):
    with pytest.raises((AssertionError, TranscoderFormatError), match="whole W_(enc|dec)"):
        load_transcoder(source.path, lazy_decoder=False)


def test_a_streamed_encoder_reads_only_its_slice(tmp_path, guarded):
    path = _mntss(tmp_path, "jumprelu")
    part = load_transcoder(path, shard=(2, 3), lazy_encoder=True)
    assert part.W_enc is None
    guarded.clear()
    weight = part.encoder_weight(1)
    assert weight.shape == (part.n_local, D) and guarded == [("W_enc_1", (part.n_local, D))]
    whole_streamed = load_transcoder(path, lazy_encoder=True)  # no W_enc read at load
    with pytest.raises(AssertionError, match="whole W_enc_1"):  # control
        whole_streamed.encoder_weight(1)
    sharded = whole_streamed.shard(2, 3)  # the loader of a shard() reads the slice too
    assert torch.equal(sharded.encoder_weight(1), weight)


# ------------------------------------------------------------------------------ memory
def test_resident_bytes_of_a_shard_is_its_share(tmp_path):
    path = _mntss(tmp_path, "jumprelu")
    whole = load_transcoder(path, lazy_decoder=False)
    feature_bytes = sum(w.nbytes for w in whole.W_dec) + whole.W_enc.nbytes \
        + whole.b_enc.nbytes + whole.threshold.nbytes
    assert whole.resident_bytes() == feature_bytes + whole.b_dec.nbytes
    halves = [load_transcoder(path, shard=(rank, 2), lazy_decoder=False) for rank in range(2)]
    assert all(h.resident_bytes() <= 0.55 * whole.resident_bytes() for h in halves)
    assert sum(h.resident_bytes() for h in halves) == feature_bytes + 2 * whole.b_dec.nbytes
    assert all(whole.shard(r, 2).resident_bytes() == halves[r].resident_bytes() for r in range(2))
    mapped = load_transcoder(path, shard=(0, 2))
    assert mapped.resident_bytes() == halves[0].resident_bytes() \
        - sum(w.nbytes for w in halves[0].W_dec)  # a mapped decoder counts 0


# ------------------------------------------------------------------------------ refusals
def _ranked(activation: str) -> Transcoder:
    g = torch.Generator().manual_seed(0)
    return Transcoder.from_tensors(
        "tiny", torch.randn(L, F, D, generator=g), torch.zeros(L, F), None, torch.zeros(L, D),
        [torch.randn(F, L - layer, D, generator=g) for layer in range(L)], activation=activation,
        k=4, score_weight=torch.ones(L, F) if activation == "joint_topk" else None)


@pytest.mark.parametrize("activation", ["topk", "relu_topk", "joint_topk"])
def test_a_topk_shard_outside_a_distributed_run_refuses_to_encode(activation):
    """A top-k shard ranks its features against the other ranks' (a collective inside a
    distributed run, tests/test_distributed.py): alone it cannot tell which are kept, so it
    says so rather than keep its own k best. The whole encodes (the control)."""
    whole = _ranked(activation)
    inputs = _inputs(4)
    assert (whole.encode_all(inputs) != 0).any()
    part = whole.shard(1, 3)
    lo, hi = part.features
    assert torch.equal(part.W_enc, whole.W_enc[:, lo:hi])
    alone = (f"one rank's shard of its features .*its {activation} ranks them against the "
             "other ranks' features: alone it cannot tell which 4 are kept; encode it under "
             "torchrun")
    with pytest.raises(InputError, match=alone):
        part.encode_all(inputs)
    with pytest.raises(InputError, match=alone):
        if activation == "joint_topk":
            part.joint_selection(inputs)
        else:
            part.encode(inputs[0], 0)
    if activation == "joint_topk":  # given the selection, a layer's features need no ranking
        selection = whole.joint_selection(inputs)[..., lo:hi]
        assert torch.equal(part.encode(inputs[2], 2, selection[2]),
                           whole.encode_all(inputs, zero_bos=False)[2, :, lo:hi])


def test_sharded_topk_layouts_load_their_slices(tmp_path):
    """circuit-tracer TopK, sparsify and ByteDance are read in slices: each shard's tensors are
    the whole's slices."""
    topk = write_circuit_tracer(tmp_path / "topk", random_set(L, D, F, activation="topk", k=4))
    sparsify = write_sparsify(tmp_path / "sp", random_set(L, D, F, activation="relu_topk", k=4))
    joint = write_bytedance(tmp_path / "bd", bytedance_tensors(L, D, F, k=2))
    for path, activation in ((topk, "topk"), (sparsify, "relu_topk"), (joint, "joint_topk")):
        whole = load_transcoder(path)
        part = load_transcoder(path, shard=(1, 2))
        lo, hi = part.features
        assert (part.cfg.activation, (lo, hi)) == (activation, feature_range(F, 1, 2))
        assert torch.equal(part.W_enc, whole.W_enc[:, lo:hi])
        assert torch.equal(part.b_enc, whole.b_enc[:, lo:hi])
        assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part.W_dec, whole.W_dec,
                                                             strict=True))
        if activation == "joint_topk":
            assert torch.equal(part.score_weight, whole.score_weight[:, lo:hi])


def test_a_shard_of_a_shard_and_saving_a_shard_are_refused(tmp_path):
    path = _mntss(tmp_path, "jumprelu")
    part = load_transcoder(path).shard(0, 2)
    with pytest.raises(InputError, match=r"already a shard \(features \(0, 24\)\)"):
        part.shard(0, 2)
    with pytest.raises(InputError, match="is a shard .*write the whole one"):
        part.save_model(str(tmp_path / "out"))
    with pytest.raises(InputError, match=r"shard=3 \(int\): expected a pair"):
        load_transcoder(path, shard=3)
    with pytest.raises(InputError, match="world=48 ranks cannot share d_transcoder=47"):
        load_transcoder(path, shard=(0, 48))


def test_a_constructor_shard_must_hold_its_range():
    g = torch.Generator().manual_seed(0)
    whole = Transcoder.from_tensors(
        "tiny", torch.randn(L, F, D, generator=g), torch.zeros(L, F), torch.zeros(L, F),
        torch.zeros(L, D), [torch.randn(F, L - layer, D, generator=g) for layer in range(L)])
    with pytest.raises(InputError, match=r"holds 10 features per layer; got \{'b_enc': 47"):
        Transcoder(whole.cfg, b_enc=whole.b_enc, threshold=whole.threshold, b_dec=whole.b_dec,
                   W_enc=whole.W_enc, W_dec=whole.W_dec, features=(0, 10))
    with pytest.raises(InputError, match=r"features \(40, 50\) is not a range"):
        Transcoder(whole.cfg, b_enc=whole.b_enc, threshold=whole.threshold, b_dec=whole.b_dec,
                   W_enc=whole.W_enc, W_dec=whole.W_dec, features=(40, 50))


def test_sliced_loads_still_check_every_layer(tmp_path):
    config = _circuit_tracer(tmp_path)
    file = config.parent / "layer_2.safetensors"
    stored = load_file(str(file))
    stored["W_enc"] = torch.randn(F + 1, D)  # a row more than b_enc says
    save_file(stored, str(file))
    with pytest.raises(TranscoderFormatError, match=r"layer_2.safetensors: shapes \{'W_enc': "
                                                    r"\(48, 32\)\}"):
        load_transcoder(config, shard=(0, 2))
    stored["W_enc"] = torch.randn(F + 1, D)
    stored["b_enc"] = torch.randn(F + 1)
    stored["activation_function.threshold"] = torch.rand(F + 1)
    stored["W_dec"] = torch.randn(F + 1, D)
    save_file(stored, str(file))
    with pytest.raises(TranscoderFormatError, match=r"layer 2\): d_transcoder 48, d_model 32 "
                                                    r"disagree with layer 0 \(d_transcoder 47"):
        load_transcoder(config, shard=(0, 2))


def test_a_layout_loaded_whole_is_sharded_after(tmp_path):
    tensors = random_set(L, D, F, seed=6)
    root = write_gemmascope(tmp_path / "gs", tensors)
    whole = load_transcoder(root, format="gemmascope")
    part = load_transcoder(root, format="gemmascope", shard=(2, 3))
    lo, hi = part.features
    assert torch.equal(part.W_enc, whole.W_enc[:, lo:hi])
    assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part.W_dec, whole.W_dec, strict=True))
    inputs = _inputs(3)
    assert torch.equal(part.encode_all(inputs), whole.encode_all(inputs)[..., lo:hi])


@pytest.mark.parametrize("layout", ["gemmascope", "gemmascope2"])
def test_a_per_layer_layout_is_cut_as_each_layer_is_read(tmp_path, monkeypatch, layout):
    """GemmaScope's npz and GemmaScope-2's per-layer folders are cut layer by layer: what is
    assembled is already the slice (never the whole set at once), and equals the whole's."""
    from test_transcoder_layouts_new import gs2_tensors, write_gs2_per_layer

    from pyvene_causaltrace.transcoders.formats import gemmascope, gemmascope2

    module = {"gemmascope": gemmascope, "gemmascope2": gemmascope2}[layout]
    if layout == "gemmascope":
        root = write_gemmascope(tmp_path / "gs", random_set(L, D, F, seed=6))
    else:
        root, _ = write_gs2_per_layer(tmp_path / "gs2", gs2_tensors(affine=True))
    seen = []
    plain = module.assemble_set

    def assemble_set(layers, **options):
        seen.append([int(layer.W_enc.shape[0]) for layer in layers])
        return plain(layers, **options)

    monkeypatch.setattr(module, "assemble_set", assemble_set)
    whole = load_transcoder(root, format=layout)
    part = load_transcoder(root, format=layout, shard=(1, 3))
    lo, hi = part.features
    width = whole.cfg.d_transcoder
    assert seen == [[width] * whole.n_layers, [hi - lo] * whole.n_layers]  # the control: whole
    assert part.cfg.d_transcoder == width and hi - lo < width
    assert torch.equal(part.W_enc, whole.W_enc[:, lo:hi])
    assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part.W_dec, whole.W_dec, strict=True))
    inputs = _inputs(whole.n_layers) if layout == "gemmascope" else torch.randn(
        whole.n_layers, 5, whole.cfg.d_model, generator=torch.Generator().manual_seed(3))
    assert torch.equal(part.encode_all(inputs), whole.encode_all(inputs)[..., lo:hi])


def test_sae_lens_transcoders_are_cut_as_each_is_read(tmp_path, monkeypatch):
    """sae-lens reads each transcoder whole; each is cut to the rank's slice before the next is
    read, so what is assembled is the slice (the control: unsharded, the whole width)."""
    from transcoder_fixtures import write_sae_lens

    from pyvene_causaltrace.transcoders.formats import sae_lens

    root = write_sae_lens(tmp_path / "sl", random_set(L, D, F, seed=7, skip=True))
    seen = []
    plain = sae_lens.assemble_set

    def assemble_set(layers, **options):
        seen.append([int(layer.W_enc.shape[0]) for layer in layers])
        return plain(layers, **options)

    monkeypatch.setattr(sae_lens, "assemble_set", assemble_set)
    whole = load_transcoder(root, format="sae_lens")
    part = load_transcoder(root, format="sae_lens", shard=(0, 2))
    lo, hi = part.features
    assert seen == [[F] * L, [hi - lo] * L]
    assert torch.equal(part.W_enc, whole.W_enc[:, lo:hi])
    assert all(torch.equal(a, b[lo:hi]) for a, b in zip(part.W_dec, whole.W_dec, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(part.W_skip, whole.W_skip, strict=True))


# ------------------------------------------------------------------------------ sliced layouts
#: Per layout, the feature axis of each tensor that has one (names as full regexes).
FEATURE_AXES = {
    "sparsify": {r"encoder\.weight": 0, r"encoder\.bias": 0, r"W_dec": 0},
    "bytedance": {r"W_enc_\d+": 0, r"W_dec_\d+": 0, r"W_dec_norm_\d+": 0, r"W_dec_norm": 1},
    "gemmascope2": {r"w_enc": 1, r"b_enc": 0, r"threshold": 0, r"w_dec": 0},
}
ENCODERS = {"sparsify": r"encoder\.weight", "bytedance": r"W_enc_\d+", "gemmascope2": r"w_enc"}
DECODERS = {"sparsify": r"W_dec", "bytedance": r"W_dec_\d+", "gemmascope2": r"w_dec"}


class Sliced(NamedTuple):
    layout: str  # a key of FEATURE_AXES
    path: Path
    module: object  # the module whose mmap_tensor maps the decoders


@pytest.fixture(params=["sparsify", "sparsify_legacy", "bytedance", "gs2_clt",
                        "gs2_clt_trimmed", "gs2_clt_config"])
def sliced(request, tmp_path) -> Sliced:
    """sparsify (and its legacy files, whose b_dec is folded into b_enc), ByteDance, the
    GemmaScope-2 CLT (``w_dec [F, L, D]``, ``[F, L - l, D]``, and listed by a circuit-tracer
    config), each with 47 features: uneven over 2 and 3 ranks."""
    name = request.param
    if name.startswith("sparsify"):
        tensors = random_set(L, D, F, seed=8, skip=True, activation="relu_topk", k=4)
        return Sliced("sparsify", write_sparsify(tmp_path / "sp", tensors,
                                                 legacy=name.endswith("legacy")), sparsify)
    if name == "bytedance":
        return Sliced("bytedance", write_bytedance(tmp_path / "bd",
                                                   bytedance_tensors(L, D, F, k=2, seed=9)),
                      common)
    layers = gs2_tensors(L, D, F, affine=True, clt=True, seed=10)
    if name == "gs2_clt_trimmed":  # target t of source l at t - l
        layers = [{**t, "w_dec": t["w_dec"][:, layer:]} for layer, t in enumerate(layers)]
    root = write_gs2_clt(tmp_path / "clt", layers)
    if name != "gs2_clt_config":
        return Sliced("gemmascope2", root, common)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "tiny", "model_kind": "cross_layer_transcoder",
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "hook_mlp_out",
        "transcoders": [str(root / f"params_layer_{layer}.safetensors") for layer in range(L)]}))
    return Sliced("gemmascope2", tmp_path / "config.yaml", common)




@pytest.fixture
def recorded(monkeypatch) -> list:
    """Every safetensors file opened through the recorder; returns the list of reads."""
    return record_reads(monkeypatch)


def _features_read(reads: list, layout: str, pattern: str = ".*") -> list[int]:
    """How many features each read of a tensor with a feature axis (matching ``pattern``)
    held."""
    return [shape[axis] for name, shape in reads if re.fullmatch(pattern, name)
            for feature_name, axis in FEATURE_AXES[layout].items()
            if re.fullmatch(feature_name, name)]


@pytest.mark.parametrize("lazy_decoder", [True, False])
def test_sliced_layouts_load_exactly_the_shard_of_the_whole(sliced, lazy_decoder):
    """sparsify, ByteDance and the GemmaScope-2 CLT read each rank's slice alone: tensor for
    tensor the whole's :meth:`Transcoder.shard`, copies of the slice only (the same resident
    bytes), a memory-mapped decoder still a view of its file."""
    whole = load_transcoder(sliced.path, lazy_decoder=lazy_decoder)
    assert whole.features is None and whole.cfg.d_transcoder == F
    for world in (2, 3):
        for rank in range(world):
            part = load_transcoder(sliced.path, shard=(rank, world), lazy_decoder=lazy_decoder)
            want = whole.shard(rank, world)
            assert part.features == want.features == feature_range(F, rank, world)
            assert part.cfg == whole.cfg and part.n_local == want.n_local
            for name in ("W_enc", "b_enc", "threshold", "b_dec", "score_weight"):
                a, b = getattr(part, name), getattr(want, name)
                assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
            assert len(part.W_dec) == len(want.W_dec) == L
            assert all(a.shape == b.shape and torch.equal(a, b)
                       for a, b in zip(part.W_dec, want.W_dec, strict=True))
            assert (part.W_skip is None) == (whole.W_skip is None)
            if part.W_skip is not None:
                assert all(torch.equal(a, b) for a, b in zip(part.W_skip, want.W_skip,
                                                             strict=True))
            assert bool(part._handles) == lazy_decoder == bool(want._handles)
            assert part.resident_bytes() == want.resident_bytes()
    if not whole.cfg.joint and whole.cfg.activation not in ("topk", "relu_topk"):
        inputs = _inputs(5)  # the GemmaScope-2 CLT encodes alone: its features are the whole's
        part = load_transcoder(sliced.path, shard=(2, 3), lazy_decoder=lazy_decoder)
        lo, hi = part.features
        assert torch.equal(part.encode_all(inputs), whole.encode_all(inputs)[..., lo:hi])


@pytest.mark.parametrize("lazy_decoder", [True, False])
def test_sliced_layouts_read_no_more_features_than_the_slice(sliced, recorded, monkeypatch,
                                                             lazy_decoder):
    """Every read of a tensor with a feature axis holds at most the rank's features; the
    encoders are read (so the bound means something), and the decoders through safetensors
    slices when resident, never when memory-mapped (a view: nothing read). The control: the
    same recorder sees whole encoders and decoders in an unsharded load."""
    if not lazy_decoder:
        def no_map(*args, **kwargs):
            raise AssertionError("the decoder was mapped for a resident sharded load")
        monkeypatch.setattr(sliced.module, "mmap_tensor", no_map)
    part = load_transcoder(sliced.path, shard=(1, 3), lazy_decoder=lazy_decoder)
    assert part.n_local == 16 < F
    widths = _features_read(recorded, sliced.layout)
    assert widths and max(widths) <= part.n_local, recorded
    assert _features_read(recorded, sliced.layout, ENCODERS[sliced.layout]) == [16] * L
    decoders = _features_read(recorded, sliced.layout, DECODERS[sliced.layout])
    assert decoders == ([] if lazy_decoder else [16] * L), recorded
    monkeypatch.undo()  # the control: an unsharded load, recorded the same way
    recorded.clear()
    record_reads(monkeypatch, recorded)
    load_transcoder(sliced.path, lazy_decoder=False)
    assert _features_read(recorded, sliced.layout, ENCODERS[sliced.layout]) == [F] * L
    assert _features_read(recorded, sliced.layout, DECODERS[sliced.layout]) == [F] * L


def test_a_sharded_sparsify_load_checks_every_layers_width_from_its_header(tmp_path):
    """A shard reads slices, which alone would hide a layer with more features than the first:
    the header is checked first, and the file named."""
    tensors = random_set(L, D, F, seed=8, activation="relu_topk", k=4)
    wide = random_set(L, D, F + 1, seed=8, activation="relu_topk", k=4)
    tensors["layers"][2] = wide["layers"][2]
    root = write_sparsify(tmp_path / "sp", tensors)
    with pytest.raises(TranscoderFormatError, match=r"layers\.2\.mlp/sae\.safetensors: shapes "
                                                    r"\{'encoder\.weight': \(48, 32\)"):
        load_transcoder(root, shard=(0, 2))
    with pytest.raises(TranscoderFormatError, match=r"layer 2\): shapes"):  # the control
        load_transcoder(root)


def test_a_circuit_tracer_set_of_files_read_whole_is_cut_as_each_is_read(tmp_path, monkeypatch):
    """A circuit-tracer config listing GemmaScope ``.npz`` files (read whole, one at a time):
    each is cut to the rank's slice before the next is read, so what is assembled is the slice
    (the control: unsharded, the whole width)."""
    write_gemmascope(tmp_path / "gs", random_set(L, D, F, seed=6))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "tiny", "model_kind": "transcoder_set",
        "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out",
        "transcoders": [f"gs/layer_{layer}/width_16k/average_l0_41/params.npz"
                        for layer in range(L)]}))
    seen = []
    plain = circuit_tracer.assemble_set

    def assemble_set(layers, **options):
        seen.append([int(layer.W_enc.shape[0]) for layer in layers])
        return plain(layers, **options)

    monkeypatch.setattr(circuit_tracer, "assemble_set", assemble_set)
    whole = load_transcoder(tmp_path / "config.yaml")
    part = load_transcoder(tmp_path / "config.yaml", shard=(1, 3))
    lo, hi = part.features
    assert seen == [[F] * L, [hi - lo] * L]
    want = whole.shard(1, 3)
    assert torch.equal(part.W_enc, want.W_enc) and torch.equal(part.b_enc, want.b_enc)
    assert torch.equal(part.threshold, want.threshold)
    assert all(torch.equal(a, b) for a, b in zip(part.W_dec, want.W_dec, strict=True))
