"""The first transcoder for a model: gather text, collect its MLPs' inputs and outputs, fit,
check on held-out text, save under a name that says what it is (docs/transcoders.md, "A first
transcoder", gives the recipe, its settings and what is refused).

    report = fit_transcoder()  # saved at transcoder_dir(): .../smollm2-135m-skip-plt-256-top16
    clt = load_transcoder(report.path)

The default: a per-layer set with a skip path (``skip_plt``), the skip solved in closed form by
least squares (each MLP's linear part) and 256 TopK features per layer trained on what it
leaves, on text the model generates itself from a few generic starts (offline, and on its own
distribution; :mod:`.fit_text` samples it in batches and keeps token ids, and a per-layer set
is fitted a group of layers at a time, so memory is one group's pairs however much text).
``fit.json`` beside it records the settings and the model's fingerprint: the
same settings reuse it, others are refused unless ``refit=True``; :mod:`.fit_output` keeps the
directory fit's own and swaps a refit in whole. Sizes are bounded (:data:`LIMITS`) and checked
against memory before anything large is allocated; the model runs in eval mode.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from .arguments import checked
from .bound import BoundModel, bind
from .defaults import BOS
from .errors import InputError, NonFiniteError
from .fingerprint import model_fingerprint
from .fit_output import fit_output
from .fit_text import GENERATED_PAIRS, STARTS, generate_ids, read_pairs
from .memory import device_bytes
from .model_guard import measuring
from .models import OFFLINE_DEFAULT, cache_dir, load_model
from .prompts import first_position
from .transcoders.checks import POOR_FIT_FVU, check_pairing
from .transcoders.fit import (
    check_fit_fits,
    check_settings,
    collect_pairs,
    fast_bf16,
    fit_bytes,
    fit_pairs,
)
from .transcoders.formats import load_transcoder, save_transcoder
from .transcoders.transcoder import Transcoder

#: kind -> (fit_pairs settings, the name's tag)
KINDS = {
    "skip_plt": ({"kind": "per_layer", "skip": True, "skip_init": "lstsq"}, "skip-plt"),
    "plt": ({"kind": "per_layer", "skip": False}, "plt"),
    "clt": ({"kind": "cross_layer", "skip": False}, "clt"),
}
#: The fit's fixed parts (:func:`~.transcoders.fit.fit_pairs`); ``fit.json`` records them
#: beside the settings, so a transcoder fitted another way is never reused.
RECIPE = {"batch_size": 256, "warmup": 20, "normalize": True}
#: The median layer FVU at or below which a first transcoder counts as worth reading; from
#: :data:`~.transcoders.checks.POOR_FIT_FVU` on it is a poor fit, between the two a rough one.
READABLE_FVU = 0.3
#: The most bytes one group of layers' pairs may take: a per-layer set is fitted a group of
#: layers at a time (:func:`layer_groups`), the last group's pairs read while generating and
#: the others' by forwards over the texts kept as token ids (:mod:`.fit_text`), so a fit on
#: more text needs more forwards, not more memory.
GROUP_PAIR_BYTES = 3 * 2**30
#: ``make attribute QUALITY=...`` (``examples/first_graph.py --quality``, ``fit --quality``):
#: changes to :class:`FitSettings`' defaults.
QUALITIES = {"quick": {}, "long": {"texts": 2048, "features": 1024, "k": 32, "steps": 2000}}
#: The largest value each size setting takes: far past any fit a machine here could hold (the
#: memory check refuses what does not fit), so a typo's extra zeros are refused at once.
LIMITS = {"features": 2**20, "k": 2**20, "steps": 10**7, "texts": 10**7, "new_tokens": 8192}


def check_fit_fields(settings, limits: dict[str, int]) -> None:
    """The fields a transcoder fit and a Lorsa fit share: ``model``, the integers of
    ``limits`` (1 to the limit), ``lr``, ``seed`` and ``data``."""
    if not isinstance(settings.model, str) or not settings.model:
        raise InputError(f"model must be a model name or directory, got {settings.model!r}")
    for name, most in limits.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise InputError(f"{name} must be an integer from 1 to {most:,}, got {value!r}")
    lr = settings.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) \
            or not 0 < lr <= 1:
        raise InputError(f"lr must be a finite number above 0 and at most 1 (Adam moves each "
                         f"weight by about lr a step), got {lr!r}")
    seed = settings.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InputError(f"seed must be an integer from 0 to 2**63-1, got {seed!r}")
    data = settings.data
    if data not in ("self", "known_1000") and not Path(data).expanduser().is_file():
        raise InputError(f"data must be 'self', 'known_1000' or a text/JSON file; no file "
                         f"at {data}")


@dataclass(frozen=True)
class FitSettings:
    """What a first transcoder is fitted with; ``fit.json`` records them."""

    model: str = OFFLINE_DEFAULT
    kind: str = "skip_plt"
    features: int = 256
    activation: str = "relu_topk"  # relu_topk (k a layer and token), relu (L1) or jumprelu
    k: int = 16  # relu_topk's features kept per layer and token (at most features)
    steps: int = 400
    lr: float = 5e-3
    data: str = "self"  # "self" (text the model generates), "known_1000", or a file
    texts: int = 480  # training texts; a tenth as many more (4 to 32) are held out
    new_tokens: int = 48  # per generated text
    seed: int = 0

    def check(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        check_fit_fields(self, LIMITS)
        options = KINDS[self.kind][0]
        if options["kind"] == "cross_layer" and self.activation == "relu_topk":
            raise InputError("a cross-layer transcoder is saved in the mntss layout, which holds "
                             "JumpReLU or ReLU features only: fit it with --activation relu or "
                             "jumprelu")
        check_settings(self.activation, options["kind"], options["skip"], self.fit_k,
                       self.features)

    @property
    def fit_k(self) -> int | None:
        """``k`` as the fit takes it and ``fit.json`` records it: at most ``features``, None
        unless the activation is ``relu_topk``."""
        return min(self.k, self.features) if self.activation == "relu_topk" else None


@dataclass(frozen=True)
class FitReport:
    """A first transcoder: where it is, whether it was fitted now or reused, and what
    ``fit.json`` records (settings, held-out pairing, the seconds of each phase)."""

    path: Path
    reused: bool
    record: dict = field(default_factory=dict)

    def summary(self) -> str:
        pairing, settings = self.record["pairing"], self.record["settings"]
        how = "reused" if self.reused else "fitted in " + ", ".join(
            f"{k} {v:.0f} s" for k, v in self.record["seconds"].items())
        median = pairing["median_layer_fvu"]
        top = f" (top {settings['k']} a token)" if settings.get("k") else ""
        # the pooled FVU weighs each layer by its output's variance (the last layers' and
        # position 0's outputs are large): the per-layer median says how a typical layer fits
        return (f"{self.path}: {settings['kind']}, {settings['features']} "
                f"{settings.get('activation', 'relu')} features per layer{top}, held-out "
                f"pairing FVU {pairing['fvu']:.3f} pooled, {median:.2f} the median layer (mean "
                f"L0 {pairing['mean_l0']:.1f}): {fit_words(median)}; {how}")


def fit_words(median: float) -> str:
    """How a first transcoder whose median layer FVU is ``median`` fits, in words."""
    share = f"a typical layer leaves {median:.0%} of its MLP output's variance to the error nodes"
    if median <= READABLE_FVU:
        return f"a fit worth reading ({share})"
    return (f"{'a poor' if median >= POOR_FIT_FVU else 'a rough'} fit — {share}, where one "
            f"worth reading leaves at most {READABLE_FVU:.0%}")


def transcoder_dir(settings: FitSettings = FitSettings()) -> Path:
    """Where :func:`fit_transcoder` writes:
    ``cache_dir()/transcoders/<model>-<kind>-<features>[-<activation>]`` (``top<k>`` for
    ``relu_topk``, nothing for ``relu``), e.g.
    ``~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16``; ``<model>``:
    the bundled model's name, else the path's or hub id's last two parts."""
    model = settings.model
    name = model if model == OFFLINE_DEFAULT else "--".join(Path(model).expanduser().parts[-2:])
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "model"
    tag = KINDS[settings.kind][1] if settings.kind in KINDS else settings.kind
    activation = {"relu": "", "relu_topk": f"-top{settings.fit_k}"}.get(
        settings.activation, f"-{settings.activation}")
    return cache_dir() / "transcoders" / f"{slug}-{tag}-{settings.features}{activation}"


@contextmanager
def phase(name: str, progress: bool, seconds: dict, desc: str | None = None) -> Iterator[None]:
    """A one-step bar (saying ``desc``, default ``name``) for a phase without steps of its own
    (``progress=False`` for one with a bar of its own); its seconds are added to
    ``seconds[name]``."""
    start = time.perf_counter()
    with tqdm(total=1, desc=desc or name, disable=not progress,
              bar_format="{desc}: {elapsed}") as bar:
        yield
        bar.update(1)
    seconds[name] = round(seconds.get(name, 0) + time.perf_counter() - start, 1)


def layer_groups(n_layers: int, per_layer: bool, pair_bytes: int) -> list[list[int]]:
    """The layers fitted together, as even as they can be: all of them for a cross-layer
    transcoder (every layer writes to those after it); for a per-layer set as many as keep
    one group's pairs (``pair_bytes`` a layer) within :data:`GROUP_PAIR_BYTES`."""
    size = n_layers if not per_layer else max(1, min(n_layers, GROUP_PAIR_BYTES // pair_bytes))
    count = math.ceil(n_layers / size)
    bounds = [round(n_layers * g / count) for g in range(count + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


def _join(parts: list[Transcoder]) -> Transcoder:
    """One per-layer set from sets fitted on consecutive groups of layers."""
    if len(parts) == 1:
        return parts[0]
    cfg = parts[0].cfg

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(part, name) for part in parts])

    return Transcoder.from_tensors(
        cfg.model_name, cat("W_enc"), cat("b_enc"), cat("threshold"), cat("b_dec"),
        [w for part in parts for w in part.W_dec],
        [w for part in parts for w in part.W_skip] if cfg.skip else None,
        model_kind=cfg.model_kind, activation=cfg.activation, k=cfg.k,
        device=parts[0].device_)


def read_texts(data: str, n: int) -> list[str]:
    """``n`` texts from ``known_1000`` or a file: facts (JSON list or JSONL, ``prompt`` +
    ``attribute``) or one text per line."""
    from .dataset.records import read_records  # the dataset floor loads only for facts

    path = Path(data).expanduser()
    if data == "known_1000" or path.suffix in (".json", ".jsonl"):
        records, _ = read_records(data if data == "known_1000" else path)
        texts = [f"{r.prompt}{r.target}" for r in records]
    else:
        texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    if len(texts) < 2:
        raise InputError(f"{data} holds {len(texts)} texts; a fit needs some to train on and "
                         "some to hold out")
    return texts[:n]


def _data_identity(data: str) -> str:
    """What ``fit.json`` records of the data: the name, or a file's path and content hash."""
    if data in ("self", "known_1000"):
        return data
    path = Path(data).expanduser().resolve()
    return f"{path} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


@checked
def fit_transcoder(settings: FitSettings | None = None, *, out: str | Path | None = None,
                   refit: bool = False, progress: bool = True,
                   model: torch.nn.Module | str | Path | None = None, tokenizer=None,
                   **changes) -> FitReport:
    """Fit the first transcoder for ``settings.model`` (keyword ``changes`` override
    :class:`FitSettings`' defaults) into ``out`` (default :func:`transcoder_dir`), or reuse the
    one there when ``fit.json`` records the same settings and model. Another transcoder there is
    refused, naming what differs, unless ``refit``; a folder fit did not write is always
    refused (:mod:`.fit_output`). ``model``/``tokenizer``: an already loaded model (else
    :func:`load_model` loads ``settings.model``; a string ``model`` is that setting). Progress
    bars and the memory estimate go to stderr; ``progress=False`` silences them."""
    if isinstance(model, (str, os.PathLike)):  # a name or directory: the setting, not a module
        changes["model"], model = os.fspath(model), None
    settings = FitSettings(**{**(asdict(settings) if settings else {}), **changes})
    settings.check()
    if model is not None and tokenizer is None:
        raise InputError("a loaded model needs its tokenizer (tokenizer=...)")
    path = Path(out).expanduser() if out is not None else transcoder_dir(settings)
    with fit_output(path) as output:
        record = None if refit else output.record()  # a damaged one refused before loading
        seconds: dict[str, float] = {}
        if model is None:
            with phase("load model", progress, seconds, f"loading {settings.model}"):
                model, tokenizer = load_model(settings.model)
        asked = dict(asdict(settings), k=settings.fit_k, data=_data_identity(settings.data),
                     recipe=dict(RECIPE), model_fingerprint=model_fingerprint(model))
        if record is not None:
            output.refuse_other_settings(record, asked, "a transcoder fitted")
            return FitReport(path, True, record)
        with measuring(model):  # eval mode (no dropout) for every forward; modes restored
            transcoder, record = _fit(bind(model), tokenizer, settings, asked, progress, seconds)

        def write(tmp: Path) -> None:
            save_transcoder(transcoder, tmp)
            load_transcoder(tmp)  # what was written reads back

        with phase("saving", progress, {}):  # not in the record it writes (a reuse reads that)
            output.commit(write, record)
    return FitReport(path, False, record)


def _fit(bound: BoundModel, tokenizer, settings: FitSettings, asked: dict, progress: bool,
         seconds: dict) -> tuple:
    """Gather text, collect, fit and check: ``(transcoder, the record fit.json will hold)``."""
    n_held = min(32, max(4, settings.texts // 10))  # held out for the pairing FVU
    have = device_bytes(bound.device)
    options = KINDS[settings.kind][0]
    generated = settings.data == "self"
    pair_dtype = GENERATED_PAIRS if generated else torch.float32

    def check_memory(n_tokens: int, n_layers: int, what: str) -> None:
        need = fit_bytes(n_tokens, n_layers, bound.d_model, settings.features, **options,
                         element_bytes=pair_dtype.itemsize, pieces=not generated)
        check_fit_fits(need, have, what)
        if progress:
            tqdm.write(f"fit: {n_tokens:,} tokens x {n_layers} layers, "
                       f"{settings.features} features per layer: about {need / 2**20:,.0f} MB "
                       f"of the {have / 2**20:,.0f} MB available", file=sys.stderr)

    def fit(x, y) -> tuple:
        return fit_pairs(x, y, settings.model, d_transcoder=settings.features,
                         steps=settings.steps, lr=settings.lr, seed=settings.seed,
                         activation=settings.activation, k=settings.fit_k, progress=progress,
                         memory_bytes=have, consume=True, bf16=bf16, **options, **RECIPE)

    bf16 = fast_bf16(bound.device)  # the steps' products: twice as fast where native
    parts, fvus = [], []
    if generated:  # the last group's pairs read while generating, the others' by forwards
        first = first_position(tokenizer, BOS)
        longest = max(len(tokenizer(opening)["input_ids"]) for opening in STARTS)
        longest += settings.new_tokens
        n_tokens = settings.texts * longest
        groups = layer_groups(bound.n_layers, options["kind"] == "per_layer",
                              2 * n_tokens * bound.d_model * pair_dtype.itemsize)
        check_memory(n_tokens, max(map(len, groups)),
                     f"{settings.texts} generated texts of up to {longest} tokens")
        with phase("generate text, collect activations", False, seconds):  # its own bar
            ids, x, y = generate_ids(bound, tokenizer, settings.texts + n_held,
                                     settings.new_tokens, settings.seed, first=first,
                                     keep=groups[-1], record=settings.texts, dtype=pair_dtype,
                                     progress=progress)
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        for number, group in enumerate([groups[-1], *groups[:-1]]):
            if number:
                with phase("collect activations", False, seconds):
                    x, y = read_pairs(bound, ids[:settings.texts], group, first=first,
                                      dtype=pair_dtype, progress=progress)
            with phase("fit", False, seconds):
                transcoder, stats = fit(x, y)
            del x, y
            parts.append(transcoder)
            fvus += [stats.train_fvu] * len(group)
        parts = parts[1:] + parts[:1]  # back in the layers' order
    else:
        with phase("gathering text", progress, seconds):
            texts = read_texts(settings.data, settings.texts + n_held)
            n_held = max(1, len(texts) // 11) if len(texts) < settings.texts + n_held else n_held
        check_memory(sum(len(ids) for ids in tokenizer(texts[:-n_held])["input_ids"]),
                     bound.n_layers, f"{len(texts) - n_held} texts of {settings.data}")
        with phase("collect activations", False, seconds):
            x, y = collect_pairs(bound.model, tokenizer, texts[:-n_held], progress=progress)
        with phase("fit", False, seconds):
            transcoder, stats = fit(x, y)
        del x, y
        parts, fvus = [transcoder], [stats.train_fvu]
    transcoder = _join(parts)
    train_fvu = sum(fvus) / len(fvus)  # the mean over layers, as one fit's
    train, held_out = texts[:-n_held], texts[-n_held:]
    with phase("held-out pairing check", progress, seconds):
        pairing = check_pairing(bound.model, tokenizer, transcoder, held_out)
    if not (math.isfinite(train_fvu) and math.isfinite(pairing.fvu)):
        raise NonFiniteError(f"the fit's FVU is not finite (train {train_fvu}, held-out "
                             f"{pairing.fvu}): nothing saved; lower lr (it was {settings.lr:g})")
    record = {"settings": asked, "train_tokens": stats.n_tokens, "train_texts": len(train),
              "held_out_texts": len(held_out), "train_fvu": train_fvu,
              "products": "bfloat16" if bf16 else "float32",
              "pairing": pairing.to_dict(), "seconds": seconds}
    return transcoder, record


SETTING_NAMES = tuple(f.name for f in fields(FitSettings))
