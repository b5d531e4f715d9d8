"""The first transcoder for a model: gather text, collect its MLPs' inputs and outputs, fit,
check on held-out text, save under a name that says what it is.

    report = fit_transcoder()  # ~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-128
    clt = load_transcoder(report.path)

The default is the fit that reached the best held-out pairing FVU per CPU minute on SmolLM2-135M
(examples/results/first_graph.json): a per-layer set with a skip path (``skip_plt``), the skip
solved in closed form by least squares (the linear part of each MLP) and 128 ReLU features per
layer trained on what it leaves, on text the model generates itself from a few generic starts
(offline, and on its own distribution). ``data`` may instead name ``known_1000`` (fetched once)
or a file: one text per line, or facts as JSON / JSONL (``prompt`` + ``attribute``).

The directory holds the transcoder and ``fit.json``, the settings it was fitted with (and the
model's fingerprint): a later call with the same settings reuses it; with other settings it is
refused, naming what differs, unless ``refit=True`` replaces it. Fit writes only into a new
directory or one holding its own ``fit.json``, one fit at a time, and swaps a refit in whole
(:mod:`.fit_output`). Sizes are bounded (:data:`LIMITS`) and checked against memory before
anything large is allocated; the model runs in eval mode, its mode restored afterwards.
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
from .errors import InputError, NonFiniteError
from .fingerprint import model_fingerprint
from .fit_output import RECORD, fit_output
from .model_guard import measuring
from .models import OFFLINE_DEFAULT, cache_dir, load_model
from .transcoders.checks import check_pairing
from .transcoders.fit import (
    check_fit_fits,
    check_settings,
    collect_pairs,
    device_bytes,
    fit_bytes,
    fit_pairs,
)
from .transcoders.formats import load_transcoder, save_transcoder

#: kind -> (fit_pairs settings, the name's tag)
KINDS = {
    "skip_plt": ({"kind": "per_layer", "skip": True, "skip_init": "lstsq"}, "skip-plt"),
    "plt": ({"kind": "per_layer", "skip": False}, "plt"),
    "clt": ({"kind": "cross_layer", "skip": False}, "clt"),
}
#: Where the model's own text starts: generic openings of encyclopedic sentences.
STARTS = (
    "The city of", "The capital of", "The river", "The museum", "The famous", "He was born in",
    "She is a", "The company", "The language of", "The team", "In 1990,", "The mountain",
    "The university", "The album", "The tower", "The bridge", "The president of", "The church",
    "The island of", "The film", "The author", "The novel", "The airport", "The country",
    "The song", "The street", "The station", "The painter", "The king of", "The football club",
    "The lake", "The castle",
)
FIT_RECORD = RECORD
#: The largest value each size setting takes: far past any fit a machine here could hold (the
#: memory check refuses what does not fit), so a typo's extra zeros are refused at once.
LIMITS = {"features": 2**20, "steps": 10**7, "texts": 10**7, "new_tokens": 8192}
SEED_RANGE = (0, 2**63 - 1)


@dataclass(frozen=True)
class FitSettings:
    """What a first transcoder is fitted with; ``fit.json`` records them."""

    model: str = OFFLINE_DEFAULT
    kind: str = "skip_plt"
    features: int = 128
    steps: int = 300
    lr: float = 5e-3
    data: str = "self"  # "self" (text the model generates), "known_1000", or a file
    texts: int = 160  # training texts; a tenth as many more are held out for the pairing FVU
    new_tokens: int = 48  # per generated text
    seed: int = 0

    def check(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.model, str) or not self.model:
            raise InputError(f"model must be a model name or directory, got {self.model!r}")
        for name, most in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise InputError(f"{name} must be an integer from 1 to {most:,}, got {value!r}")
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) \
                or not 0 < lr <= 1:
            raise InputError(f"lr must be a finite number above 0 and at most 1 (Adam moves each "
                             f"weight by about lr a step), got {lr!r}")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or \
                not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise InputError(f"seed must be an integer from 0 to 2**63-1, got {seed!r}")
        if self.data not in ("self", "known_1000") and not Path(self.data).expanduser().is_file():
            raise InputError(f"data must be 'self', 'known_1000' or a text/JSON file; no file "
                             f"at {self.data}")
        options = KINDS[self.kind][0]
        check_settings(kind=options["kind"], skip=options["skip"])


@dataclass(frozen=True)
class FitReport:
    """A first transcoder: where it is, whether it was fitted now or reused, and what
    ``fit.json`` records (settings, held-out pairing, the seconds of each phase)."""

    path: Path
    reused: bool
    record: dict = field(default_factory=dict)

    def summary(self) -> str:
        pairing, seconds = self.record["pairing"], self.record["seconds"]
        how = "reused" if self.reused else "fitted in " + ", ".join(
            f"{k} {v:.0f} s" for k, v in seconds.items())
        per_layer = sorted(pairing["fvu_per_layer"])
        median = per_layer[len(per_layer) // 2]
        # the pooled FVU weighs each layer by its output's variance (the last layers' and
        # position 0's outputs are large): the per-layer median says how a typical layer fits
        return (f"{self.path}: {self.record['settings']['kind']}, "
                f"{self.record['settings']['features']} features per layer, held-out pairing "
                f"FVU {pairing['fvu']:.3f} pooled, {median:.2f} the median layer (mean L0 "
                f"{pairing['mean_l0']:.1f}); {how}")


def model_slug(model: str) -> str:
    """A model's name as a folder name: the bundled one's, else the path's or hub id's last
    parts."""
    name = model if model == OFFLINE_DEFAULT else "--".join(Path(model).expanduser().parts[-2:])
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "model"


def transcoder_dir(settings: FitSettings = FitSettings()) -> Path:
    """Where :func:`fit_transcoder` writes: ``cache_dir()/transcoders/<model>-<kind>-<features>``,
    e.g. ``~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-128``."""
    tag = KINDS[settings.kind][1] if settings.kind in KINDS else settings.kind
    return cache_dir() / "transcoders" / f"{model_slug(settings.model)}-{tag}-{settings.features}"


@contextmanager
def phase(name: str, progress: bool, seconds: dict) -> Iterator[None]:
    """A one-step bar for a phase without steps of its own; its seconds go to ``seconds``."""
    start = time.perf_counter()
    with tqdm(total=1, desc=name, disable=not progress, bar_format="{desc}: {elapsed}") as bar:
        yield
        bar.update(1)
    seconds[name] = round(time.perf_counter() - start, 1)


def generate_texts(model, tokenizer, n: int, new_tokens: int, seed: int,
                   progress: bool = False) -> list[str]:
    """``n`` texts the model writes itself: each of :data:`STARTS` in turn, continued by
    ``new_tokens`` sampled tokens (temperature 1, seeded; the caller's random state is left as
    it was). Starts of one token length share a batch, so nothing is padded."""
    starts = [STARTS[i % len(STARTS)] for i in range(n)]
    groups: dict[int, list[tuple[int, list[int]]]] = {}
    for i, start in enumerate(starts):
        ids = tokenizer(start)["input_ids"]
        groups.setdefault(len(ids), []).append((i, ids))
    texts: list[str] = [""] * n
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[]), torch.no_grad(), \
            tqdm(total=n, desc="generating text", unit="text", disable=not progress) as bar:
        torch.manual_seed(seed)
        for _, group in sorted(groups.items()):
            for begin in range(0, len(group), 32):
                chunk = group[begin:begin + 32]
                ids = torch.tensor([ids for _, ids in chunk], device=device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     do_sample=True, temperature=1.0, top_k=0,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     pad_token_id=tokenizer.eos_token_id)
                for (i, _), row in zip(chunk, out, strict=True):
                    texts[i] = tokenizer.decode(row, skip_special_tokens=True)
                bar.update(len(chunk))
    return texts


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


def _asked(settings: FitSettings, fingerprint: str) -> dict:
    return dict(asdict(settings), data=_data_identity(settings.data), model_fingerprint=fingerprint)


def _differences(recorded: dict, asked: dict) -> list[str]:
    return [f"{k} {recorded.get(k)!r} (asked {v!r})" for k, v in asked.items()
            if recorded.get(k) != v]


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
            with phase(f"loading {settings.model}", progress, seconds):
                model, tokenizer = load_model(settings.model)
            seconds["load model"] = seconds.pop(f"loading {settings.model}")
        asked = _asked(settings, model_fingerprint(model))
        if record is not None:
            differ = _differences(record["settings"], asked)
            if differ:
                raise InputError(f"{path} holds a transcoder fitted with other settings: "
                                 f"{'; '.join(differ)}. Pass refit=True (--refit) to replace "
                                 "it, or another out")
            return FitReport(path, True, record)
        with measuring(model):  # eval mode (no dropout) for every forward; modes restored
            transcoder, record = _fit(bind(model), tokenizer, settings, asked, progress, seconds)

        def write(tmp: Path) -> None:
            save_transcoder(transcoder, tmp)
            load_transcoder(tmp)  # what was written reads back

        with phase("saving", progress, {}):  # not in the record it writes (a reuse reads that)
            output.commit(write, record)
    return FitReport(path, False, record)


def available_bytes(device) -> int:
    """Memory a fit on ``device`` may use: a GPU's, else what this process may use of the
    machine's (its control group's limit)."""
    from .dataset.plan import machine_memory  # the dataset floor loads only for a fit

    return device_bytes(device) if device.type == "cuda" else machine_memory()


def _fit(bound: BoundModel, tokenizer, settings: FitSettings, asked: dict, progress: bool,
         seconds: dict) -> tuple:
    """Gather text, collect, fit and check: ``(transcoder, the record fit.json will hold)``."""
    model = bound.model
    n_held = max(4, settings.texts // 10)
    have = available_bytes(bound.device)
    options = KINDS[settings.kind][0]

    def check_memory(n_tokens: int, what: str) -> None:
        need = fit_bytes(n_tokens, bound.n_layers, bound.d_model, settings.features, **options)
        check_fit_fits(need, have, what)
        if progress:
            tqdm.write(f"fit: {n_tokens:,} tokens x {bound.n_layers} layers, "
                       f"{settings.features} features per layer: about {need / 2**20:,.0f} MB "
                       f"of the {have / 2**20:,.0f} MB available", file=sys.stderr)

    with phase("gathering text", progress and settings.data != "self", seconds):
        if settings.data == "self":
            longest = max(len(tokenizer(start)["input_ids"]) for start in STARTS)
            check_memory(settings.texts * (longest + settings.new_tokens),
                         f"{settings.texts} generated texts of up to "
                         f"{longest + settings.new_tokens} tokens")
            texts = generate_texts(model, tokenizer, settings.texts + n_held,
                                   settings.new_tokens, settings.seed, progress)
        else:
            texts = read_texts(settings.data, settings.texts + n_held)
            n_held = max(1, len(texts) // 11) if len(texts) < settings.texts + n_held else n_held
    train, held_out = texts[:-n_held], texts[-n_held:]
    if settings.data != "self":
        check_memory(sum(len(ids) for ids in tokenizer(train)["input_ids"]),
                     f"{len(train)} texts of {settings.data}")
    start = time.perf_counter()
    x, y = collect_pairs(model, tokenizer, train, progress=progress)
    seconds["collect activations"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    transcoder, stats = fit_pairs(x, y, settings.model, d_transcoder=settings.features,
                                  steps=settings.steps, lr=settings.lr, seed=settings.seed,
                                  progress=progress, memory_bytes=have, **options)
    seconds["fit"] = round(time.perf_counter() - start, 1)
    del x, y
    with phase("held-out pairing check", progress, seconds):
        pairing = check_pairing(model, tokenizer, transcoder, held_out)
    if not (math.isfinite(stats.train_fvu) and math.isfinite(pairing.fvu)):
        raise NonFiniteError(f"the fit's FVU is not finite (train {stats.train_fvu}, held-out "
                             f"{pairing.fvu}): nothing saved; lower lr (it was {settings.lr:g})")
    record = {"settings": asked, "train_tokens": stats.n_tokens, "train_texts": len(train),
              "held_out_texts": len(held_out), "train_fvu": stats.train_fvu,
              "pairing": pairing.to_dict(), "seconds": seconds}
    return transcoder, record


SETTING_NAMES = tuple(f.name for f in fields(FitSettings))
