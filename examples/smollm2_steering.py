"""Steering SmolLM2-135M with the features of its fitted CLT: the attribution graphs of "The
Eiffel Tower is in the city of" -> " Paris" and "The Colosseum is in the city of" -> " Rome"
name the features that push the answer at the last token (largest direct effect on the target);
set them to values and generate (``intervene_features``).

    python examples/fit_smollm2_clt.py --features 256 --steps 400   # once (~16 min)
    python examples/smollm2_steering.py                              # ~10 min on 2 CPU cores

Runs, each with the errors held at the clean run's on the prompt (live at generated tokens) and
10 greedy tokens:

1. the check: every active feature at every position set to its own clean value gives back the
   clean logits (max |logit difference|);
2. ablate: the Eiffel graph's top 5 last-token features set to 0;
3. boost: its top feature at k times its activation, at the last token and at every position;
4. swap: on the Colosseum prompt, its own top 10 last-token features set to 0 and the Eiffel
   graph's top 10 set to k times their Eiffel activations.

Writes ``examples/results/steering/steering.json`` (every run's top tokens and continuations),
``spec.json`` (the ablation, as a spec that ``pyvene-causaltrace steer --spec`` and ``run``
reproduce) and ``README.md`` (the numbers).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pyvene_causaltrace import attribute, intervene_features, load_model, load_transcoder
from pyvene_causaltrace.fitting import transcoder_dir
from pyvene_causaltrace.transcoders.hooks import transcoder_states

CLT = transcoder_dir()  # the first transcoder: make attribute (or pyvene-causaltrace fit)
OUT = Path(__file__).parent / "results" / "steering"
PROMPT, ANSWER = "The Eiffel Tower is in the city of", " Paris"
OTHER = "The Colosseum is in the city of"
NEW_TOKENS = 10
BOOSTS = (2.0, 5.0, 10.0)


def prob(result, tokenizer, text: str, clean: bool = False) -> float:
    token = tokenizer(text, add_special_tokens=False)["input_ids"][0]
    logits = result.clean_logits if clean else result.logits
    return float(logits.double().softmax(-1)[token])


def every_feature_at_its_clean_value(model, clt, tokenizer, prompt: str) -> list[tuple]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    acts = clt.encode_all(transcoder_states(model, clt, ids)["input"].to(clt.dtype))
    return [(int(layer), int(pos), int(f), float(acts[layer, pos, f]))
            for layer, pos, f in zip(*acts.nonzero(as_tuple=True), strict=True)]


def top_last_token_features(model, tokenizer, clt, prompt: str, answer: str, n: int):
    """The ``n`` last-token features of largest direct effect on the answer's target (the
    graph's target row only: ``max_feature_nodes=0``), as ``(layer, feature, activation,
    direct)``."""
    graph = attribute(model, tokenizer, clt, prompt, answer, max_feature_nodes=0)
    nodes = graph.nodes()
    last = nodes[(nodes["kind"] == "feature") & (nodes["position"] == graph.n_pos - 1)]
    top = last.sort_values("direct", ascending=False).head(n)
    return [(int(r.layer), int(r.feature), float(r.activation), float(r.direct))
            for r in top.itertuples()]


def main() -> None:
    if not CLT.exists():
        raise SystemExit(f"no CLT at {CLT}: run examples/fit_smollm2_clt.py first")
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    clt = load_transcoder(str(CLT))
    paris = top_last_token_features(model, tokenizer, clt, PROMPT, ANSWER, 10)
    rome = top_last_token_features(model, tokenizer, clt, OTHER, " Rome", 10)
    layer, feature, activation, direct = paris[0]
    runs: dict[str, dict] = {}

    def run(name: str, prompt: str, items: list[tuple], **kwargs) -> None:
        result = intervene_features(model, tokenizer, clt, prompt, items,
                                    max_new_tokens=kwargs.pop("max_new_tokens", NEW_TOKENS),
                                    **kwargs)
        runs[name] = {**result.to_dict(), "p_paris": prob(result, tokenizer, " Paris"),
                      "clean_p_paris": prob(result, tokenizer, " Paris", clean=True),
                      "p_rome": prob(result, tokenizer, " Rome"),
                      "clean_p_rome": prob(result, tokenizer, " Rome", clean=True)}
        print(f"\n== {name}\n{result.summary()}", flush=True)

    clean_items = every_feature_at_its_clean_value(model, clt, tokenizer, PROMPT)
    run("clean values", PROMPT, clean_items, max_new_tokens=0)
    for key in ("interventions", "spec"):  # thousands of triples: counted, not kept
        runs["clean values"].pop(key)
    runs["clean values"]["n_interventions"] = len(clean_items)
    run("Eiffel: ablate the top 5", PROMPT, [(l_, -1, f, 0.0) for l_, f, _, _ in paris[:5]])
    for k in BOOSTS:
        run(f"Eiffel: top feature x{k:g} at the last token", PROMPT,
            [(layer, -1, feature, k * activation)])
    run(f"Eiffel: top feature x{BOOSTS[-1]:g} at every position", PROMPT,
        [(layer, "all", feature, BOOSTS[-1] * activation)])
    transplanted = {(l_, f) for l_, f, _, _ in paris}
    removed = [(l_, -1, f, 0.0) for l_, f, _, _ in rome if (l_, f) not in transplanted]
    for k in (1.0, 2.0, 5.0):
        run(f"Colosseum: swap x{k:g}", OTHER,
            removed + [(l_, -1, f, k * a) for l_, f, a, _ in paris])

    OUT.mkdir(parents=True, exist_ok=True)
    summary = {"clt": str(CLT), "prompt": PROMPT, "answer": ANSWER, "other": OTHER,
               "paris_features": [dict(zip(("layer", "feature", "activation", "direct"), t,
                                           strict=True)) for t in paris],
               "rome_features": [dict(zip(("layer", "feature", "activation", "direct"), t,
                                          strict=True)) for t in rome],
               "seconds": time.perf_counter() - start, "runs": runs}
    (OUT / "steering.json").write_text(json.dumps(summary, indent=2) + "\n")
    spec = runs["Eiffel: ablate the top 5"]["spec"]
    (OUT / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")

    def cell(text: str) -> str:
        return repr(text).replace("|", "\\|")

    lines = ["# Steering SmolLM2-135M with its fitted CLT", "",
             f"`python examples/smollm2_steering.py` ({summary['seconds']:.0f} s on 2 busy CPU "
             f"cores); CLT `{CLT.name}`; errors held at the clean run's on the prompt, live at "
             "generated tokens; attention live; greedy, 10 tokens. Features are ranked by "
             "their direct effect on the graph's target (the answer's logit minus the mean of "
             "the top-10 logits) at the last token.", "",
             f"- every active feature of {PROMPT!r} ({len(clean_items)} (layer, position, "
             "feature) triples) set to its own clean value: max |logit difference| "
             f"{runs['clean values']['max_abs_logit_diff']:.2e} (float32);",
             "- top last-token features for ' Paris': " + ", ".join(
                 f"L{l_}#{f} ({a:.2f}, {d:+.3f})" for l_, f, a, d in paris[:5])
             + " (activation, direct effect);",
             "- top last-token features for ' Rome' (Colosseum): " + ", ".join(
                 f"L{l_}#{f} ({a:.2f}, {d:+.3f})" for l_, f, a, d in rome[:5]) + ".", "",
             "| run | P(' Paris') clean -> intervened | P(' Rome') clean -> intervened | "
             "clean continuation | intervened continuation |", "|---|---|---|---|---|"]
    for name, r in runs.items():
        if name != "clean values":
            lines.append(f"| {name} | {r['clean_p_paris']:.3f} -> {r['p_paris']:.3f} | "
                         f"{r['clean_p_rome']:.3f} -> {r['p_rome']:.3f} | "
                         f"{cell(r['clean_generated_text'])} | "
                         f"{cell(r['generated_text'])} |")
    (OUT / "README.md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {OUT}/steering.json, spec.json, README.md")


if __name__ == "__main__":
    main()
