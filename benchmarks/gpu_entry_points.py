"""Issue 54 item 5: every public function and CLI command, with its defaults, on a model on
``--device`` (default cuda): does anything the package makes land on the wrong device? Each entry
point runs in its own try/except; one JSON (``--out``) records per entry point ``ok`` or the
error (type and message) and its seconds; the exit status is 1 if any failed.

The model is a random-init Llama-3.2-1B shape (float32), saved once with a BPE tokenizer trained
on known_1000's facts (no network); the transcoder a random CLT of 16 x 128 features calibrated
to fire about 8 features per position, saved in the mntss layout. Both are loaded back through
the public loaders onto the device. The commands run in this process, each given ``--device``
(every command that loads a model or a transcoder takes it), so their code runs on the device as
the API's does. Sizes the defaults would make long (the fit's texts and steps,
the dataset's facts) are cut; every device-relevant setting is the default.

    python benchmarks/gpu_entry_points.py --out entry_points.json       # on a CUDA machine
    SMOKE=1 python benchmarks/gpu_entry_points.py --device cpu          # tiny shapes, the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_clt import SHAPES, known_facts_tokenizer, synthetic_clt_for  # noqa: E402

import pyvene_causaltrace as pvct  # noqa: E402
from pyvene_causaltrace import cli  # noqa: E402
from pyvene_causaltrace.attribution import (  # noqa: E402
    attention_annotations,
    head_loadings,
    qk_attribution,
)
from pyvene_causaltrace.bound import bind  # noqa: E402
from pyvene_causaltrace.dataset import FactRecord  # noqa: E402
from pyvene_causaltrace.errors import InputError  # noqa: E402
from pyvene_causaltrace.tracing import tracer_from_spec  # noqa: E402
from pyvene_causaltrace.transcoders.checks import check_pairing, replacement_anchor  # noqa: E402

PROMPT, SUBJECT = "The Eiffel Tower is in the city of", "The Eiffel Tower"
FACTS = [(PROMPT, SUBJECT, " Paris"),
         ("The Space Needle is in the city of", "The Space Needle", " Seattle"),
         ("Danielle Darrieux's mother tongue is", "Danielle Darrieux", " French")]
SMOKE = os.environ.get("SMOKE") == "1"


def build(work: Path, shape: str, features: int, device: str) -> tuple[Path, Path]:
    """A random-init model of ``shape`` with its tokenizer, and a random CLT of ``features`` per
    layer with real decoders, made on ``device`` and saved under ``work`` (the model in
    bfloat16: half the bytes to write and read; the loaders read it back in float32):
    ``(model_dir, clt_dir)``."""
    config, _ = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    model.pvct_source = str(work / "model")
    tokenizer = known_facts_tokenizer()
    clt = synthetic_clt_for(model, tokenizer, features, 8.0, PROMPT, device,
                            source=str(work / "model"))
    g = torch.Generator().manual_seed(2)
    n_layers = clt.n_layers
    clt.W_dec = [(torch.randn(features, n_layers - layer, clt.cfg.d_model, generator=g) * 0.02)
                 .to(device) for layer in range(n_layers)]
    clt.save_model(str(work / "clt"))
    model.to(torch.bfloat16).save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return work / "model", work / "clt"


def command(argv, verdicts: tuple[int, ...] = (0,)) -> None:
    """``pyvene-causaltrace argv`` in this process; an exit status outside ``verdicts`` fails."""
    code = cli.main([str(a) for a in argv])
    if code not in verdicts:
        raise RuntimeError(f"pyvene-causaltrace {' '.join(map(str, argv))} exited {code}")


def refused(call, error: type, says: str):
    """``call``, where an ``error`` saying ``says`` is the answer, not a failure (a random-init
    model's: after the work ran on the device)."""
    try:
        call()
    except error as raised:
        if says not in str(raised):
            raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu" if SMOKE else "cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny" if SMOKE else "llama1b")
    parser.add_argument("--features", type=int, default=32 if SMOKE else 128)
    parser.add_argument("--out", type=Path, default=Path("entry_points.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="entry-points-"))
    start = time.perf_counter()
    model_dir, clt_dir = build(work, args.shape, args.features, args.device)
    model, tokenizer = pvct.load_model(str(model_dir), device=args.device)
    clt = pvct.load_transcoder(clt_dir, device=args.device)
    setup = time.perf_counter() - start
    print(f"{args.shape} on {args.device}: model, tokenizer and CLT ({args.features} features "
          f"per layer) built, saved and loaded in {setup:.1f} s", flush=True)
    answer = " Paris"
    made: dict = {}
    records = [FactRecord(str(i), p, s, a) for i, (p, s, a) in enumerate(FACTS)]
    specs = work / "specs"
    specs.mkdir()
    noise = {"type": "noise_add", "positions": "subject", "seeds": 3, "scale": 3.0,
             "sigma": "rome", "distribution": "gaussian"}
    base = {"schema_version": 1, "model": str(model_dir), "prompt": PROMPT,
            "subject": SUBJECT, "answer": answer}
    spec_files = {
        "restore": base | {"name": "restore", "interventions": [noise, {
            "type": "clean_restore", "component": "block_output", "layers": 1,
            "positions": "last"}]},
        "steering": base | {"name": "steering", "interventions": [
            {"type": "clt_splice", "clt": str(clt_dir), "error": "clean"},
            {"type": "feature_ablate", "clt_layer": 1, "features": [3, 4], "positions": [5],
             "value": [0.0, 7.5]}]},
        "trace": base | {"name": "trace", "interventions": [noise],
                         "trace": {"kind": "mlp", "window": 2}},
    }
    for name, spec in spec_files.items():
        (specs / f"{name}.json").write_text(json.dumps(spec))
    facts = work / "facts.json"
    facts.write_text(json.dumps([{"prompt": p, "subject": s, "attribute": a.strip()}
                                 for p, s, a in FACTS]))
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    (work / "direction.json").write_text(json.dumps(direction.tolist()))
    texts = [p + a for p, _, a in FACTS]

    def graph():
        return made["graph"]

    calls = {
        "load_model+load_transcoder": lambda: None,  # done above; a failure there stops all
        "trace residual": lambda: pvct.trace(model, tokenizer, PROMPT, SUBJECT, progress=False),
        **{f"trace {kind}": functools.partial(
            lambda kind: made.setdefault("tracer", pvct.Tracer(
                model, tokenizer, PROMPT, SUBJECT)).trace(kind, progress=False), kind)
           for kind in ("mlp", "attn", "severed-mlp", "severed-attn")},
        # a random-init model's P(answer) is too small for any scale to bring below 5%
        "trace scale=auto": lambda: refused(lambda: pvct.trace(
            model, tokenizer, PROMPT, SUBJECT, scale="auto", progress=False),
            InputError, "scale='auto': no scale"),
        "Tracer.trace_heads": lambda: pvct.Tracer(model, tokenizer, PROMPT, SUBJECT)
        .trace_heads(progress=False),
        "Tracer.controls": lambda: pvct.Tracer(model, tokenizer, PROMPT, SUBJECT).controls(),
        "tracer_from_spec": lambda: tracer_from_spec(str(specs / "trace.json"), model,
                                                     tokenizer).trace("mlp", progress=False),
        "attribute (no answer)": lambda: made.__setitem__(
            "graph", pvct.attribute(model, tokenizer, clt, PROMPT)),
        "attribute answer": lambda: pvct.attribute(model, tokenizer, clt, PROMPT, answer),
        "attribute difference": lambda: pvct.attribute(model, tokenizer, clt, PROMPT, answer,
                                                       target="difference", other=" Seattle"),
        "attribute direction (cpu vector)": lambda: pvct.attribute(model, tokenizer, clt, PROMPT,
                                                                   target=direction),
        "attribute direction (device vector)": lambda: pvct.attribute(
            model, tokenizer, clt, PROMPT, target=direction.to(args.device)),
        "graph export (to_json, save)": lambda: (graph().to_json(work / "graph.json"),
                                                 graph().save(work / "graph.safetensors")),
        "head_loadings": lambda: head_loadings(bind(model), clt, graph()),
        "qk_attribution": lambda: qk_attribution(bind(model), clt, graph(), 1, 0, -1, 1),
        "attention_annotations": lambda: attention_annotations(bind(model), clt, graph()),
        "intervene_features": lambda: pvct.intervene_features(
            model, tokenizer, clt, PROMPT, [(1, -1, 3, 10.0)]),
        "intervene_features generation": lambda: pvct.intervene_features(
            model, tokenizer, clt, PROMPT, [(1, "all", 3, 10.0)], max_new_tokens=8),
        "intervene_features frozen attention": lambda: pvct.intervene_features(
            model, tokenizer, clt, PROMPT, [(1, -1, 3, 10.0)], freeze_attention=True,
            hold_errors=False, max_new_tokens=4),
        "cross_check": lambda: pvct.cross_check(graph(), pvct.Tracer(
            model, tokenizer, PROMPT, SUBJECT, answer=graph().answer), clt),
        "cross_check heads": lambda: pvct.cross_check(graph(), pvct.Tracer(
            model, tokenizer, PROMPT, SUBJECT, answer=graph().answer), clt, heads=True),
        "run_spec restore": lambda: pvct.run_spec(str(specs / "restore.json"), model, tokenizer),
        "run_spec clt_splice": lambda: pvct.run_spec(str(specs / "steering.json"), model,
                                                     tokenizer),
        "trace_dataset": lambda: pvct.trace_dataset(model, tokenizer, records, out=work / "ds",
                                                    known="none", progress=False),
        "trace_dataset graphs": lambda: pvct.trace_dataset(
            model, tokenizer, records[:1], out=work / "dsg", known="none", transcoder=clt,
            progress=False),
        "check_pairing": lambda: check_pairing(model, tokenizer, clt, texts),
        "replacement_anchor": lambda: replacement_anchor(model, tokenizer, clt, texts,
                                                         prompt=PROMPT),
        "fit_transcoder": lambda: pvct.fit_transcoder(
            model=model, tokenizer=tokenizer, out=work / "fit", texts=32, steps=40,
            progress=False),
    }
    cli_calls = {
        "cli trace": ("trace", "--model", model_dir, "--kind",
                      "residual,mlp,attn,severed-mlp,severed-attn", "--controls", "--no-progress",
                      "--out", work / "cli-trace"),
        "cli run": ("run", specs / "steering.json", "--out", work / "cli-run"),
        "cli validate": ("validate", specs / "restore.json", specs / "steering.json", "--model",
                         model_dir),
        "cli attribute": ("attribute", "--model", model_dir, "--clt", clt_dir, "--out",
                          work / "cli-attr"),
        "cli attribute --answer --heads --cross-check": (
            "attribute", "--model", model_dir, "--clt", clt_dir, "--answer", answer, "--heads",
            "--cross-check", "--validate", "--out", work / "cli-attr2"),
        "cli attribute --direction": ("attribute", "--model", model_dir, "--clt", clt_dir,
                                      "--direction", work / "direction.json", "--out",
                                      work / "cli-attr3"),
        "cli steer": ("steer", "--model", model_dir, "--clt", clt_dir, "--set", "1:-1:3=10",
                      "--out", work / "cli-steer"),
        "cli clt-check": ("clt-check", "--model", model_dir, "--clt", clt_dir, "--data", facts,
                          "--limit", 3, "--out", work / "cli-check"),
        "cli dataset": ("dataset", "--model", model_dir, "--data", facts, "--known", "none",
                        "--no-progress", "--graphs", "--clt", clt_dir, "--out",
                        work / "cli-ds"),
        "cli aggregate": ("aggregate", work / "cli-ds"),
        "cli fit": ("fit", "--model", model_dir, "--texts", 32, "--steps", 40, "--no-progress",
                    "--out", work / "cli-fit"),
        "cli interventions": ("interventions",),
    }
    log = args.out.with_suffix(".log")  # what the commands print
    for name, argv in cli_calls.items():
        if argv[0] not in ("aggregate", "interventions"):  # those load no model
            argv = (*argv, "--device", args.device)
        # clt-check exits 1 when the transcoder is not paired (a random one is not)
        calls[name] = functools.partial(_cli, argv, log,
                                        (0, 1) if argv[0] == "clt-check" else (0,))

    results = {}
    for name, call in calls.items():
        begun = time.perf_counter()
        try:
            call()
            entry = {"ok": True}
        except Exception as error:  # noqa: BLE001 -- every entry point's failure is recorded
            where = traceback.extract_tb(error.__traceback__)[-1]
            entry = {"ok": False, "error": type(error).__name__,
                     "message": str(error).strip().splitlines()[0][:500] if str(error) else "",
                     "at": f"{Path(where.filename).name}:{where.lineno}"}
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        entry["seconds"] = round(time.perf_counter() - begun, 3)
        results[name] = entry
        line = "ok" if entry["ok"] else f"FAILED {entry['error']}: {entry['message']}"
        print(f"{name:45s} {entry['seconds']:8.2f} s  {line}", flush=True)
    failed = [name for name, entry in results.items() if not entry["ok"]]
    payload = {"device": args.device, "shape": args.shape, "features": args.features,
               "torch": torch.__version__, "transformers": tf.__version__,
               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
               "setup_seconds": round(setup, 1),
               "total_seconds": round(time.perf_counter() - start, 1),
               "failed": failed, "entry_points": results}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"{len(results) - len(failed)}/{len(results)} entry points ok in "
          f"{payload['total_seconds']} s; {args.out}", flush=True)
    return 1 if failed else 0


def _cli(argv, log: Path, verdicts: tuple[int, ...]) -> None:
    with log.open("a") as out, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        print(f"$ pyvene-causaltrace {' '.join(map(str, argv))}", flush=True)
        command(argv, verdicts)


if __name__ == "__main__":
    sys.exit(main())
