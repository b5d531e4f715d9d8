"""Obviously-correct reference paths for the equivalence tests: plain PyTorch hooks, one row at a
time, no pyvene."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.models import get_module


def recipe_noise(seed: int, n: int, hidden: int, scale: float, sigma: float) -> torch.Tensor:
    """DESIGN.md's noise recipe, written out independently of the package."""
    return torch.randn((n, hidden), generator=torch.Generator("cpu").manual_seed(seed),
                       dtype=torch.float32) * scale * sigma


@contextmanager
def edit_output(model, module_path: str, edit):
    """Replace ``module_path``'s output (first element of a tuple) by ``edit(output)``."""
    module = get_module(model, module_path)

    def hook(_module, _args, output):
        if isinstance(output, tuple):
            return (edit(output[0]),) + output[1:]
        return edit(output)

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def set_positions(states: torch.Tensor, positions: list[int]):
    """An ``edit`` that overwrites ``positions`` with ``states`` (batch 1)."""
    def edit(output):
        output = output.clone()
        output[:, positions] = states[:, positions].to(output.dtype)
        return output
    return edit


def add_at(delta: torch.Tensor, positions: list[int]):
    def edit(output):
        output = output.clone()
        output[:, positions] += delta.to(output.dtype)
        return output
    return edit


def reference_cell(model, ids, seed, noise_positions, scale, sigma, answer_id,
                   restores=(), freezes=()) -> float:
    """P(answer) of one row, batch 1, plain hooks: recipe noise at the input embeddings,
    ``restores`` = [(module path, states [1, seq, hidden], position)] written at that
    position, ``freezes`` likewise (states of this seed's corrupted run)."""
    from pyvene_causaltrace.models import get_adapter

    adapter = get_adapter(model)
    delta = recipe_noise(seed, len(noise_positions), bind(model).d_model, scale, sigma)
    edits = [(adapter.embed, add_at(delta, list(noise_positions)))]
    edits += [(path, set_positions(states, [pos])) for path, states, pos in [*restores, *freezes]]
    with torch.no_grad():
        with _all(model, edits):
            logits = model(input_ids=ids).logits
    return float(logits[0, -1].double().softmax(-1)[answer_id])


def reference_kind_cell(model, engine, kind, seed: int, layer: int, position: int,
                        window: int) -> float:
    """:func:`reference_cell` for one cell of trace ``kind`` (a ``TraceKind``), with the
    engine's prompt, noise and clean states (the clean run is a plain forward's capture)."""
    from pyvene_causaltrace.models import get_adapter

    adapter = get_adapter(model)
    n_layers = bind(model).n_layers
    sever = ([adapter.module_path(kind.sever, x) for x in range(n_layers)] if kind.sever else [])
    scale, sigma = engine.noise.config()["scale"], engine.noise.config()["sigma"]
    held = corrupted_states(model, engine.ids, seed, engine.noise_positions, scale, sigma, sever)
    restores = []
    for x in engine.restore_layers(kind, layer, window):
        path = adapter.module_path(kind.restore, x)
        restores.append((path, engine.clean_states[path + ".output"], position))
    freezes = [(path, held[path], position) for path in sever]
    return reference_cell(model, engine.ids, seed, engine.noise_positions, scale, sigma,
                          engine.answer_id, restores, freezes)


def corrupted_states(model, ids, seed, noise_positions, scale, sigma, paths) -> dict:
    """Outputs of ``paths`` in the batch-1 corrupted run of ``seed`` (plain hooks)."""
    from pyvene_causaltrace.models import get_adapter

    adapter = get_adapter(model)
    delta = recipe_noise(seed, len(noise_positions), bind(model).d_model, scale, sigma)
    found = {}
    hooks = []
    for path in paths:
        def keep(_m, _a, output, _path=path):
            found[_path] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        hooks.append(get_module(model, path).register_forward_hook(keep))
    try:
        with torch.no_grad(), edit_output(model, adapter.embed,
                                          add_at(delta, list(noise_positions))):
            model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return found


@contextmanager
def _all(model, edits):
    from contextlib import ExitStack

    with ExitStack() as stack:
        for path, edit in edits:
            stack.enter_context(edit_output(model, path, edit))
        yield


def reload_in_fresh_process(tmp_path, model, pv_model, ids) -> tuple[list[str], bool, str]:
    """Save ``model`` and ``pv_model`` (pyvene's own ``save``), load both back with our
    ``IntervenableModel.load`` in a new Python process and run ``ids`` there; then load them
    with pyvene's own ``pv.IntervenableModel.load`` and run again. Returns the loaded
    intervention class names (sorted, unique), whether our load's logits are bit-identical to
    this process's, and what pyvene's load's run raised (``"Class: message"``, or "")."""
    import json
    import subprocess
    import sys
    import textwrap

    model.save_pretrained(tmp_path / "model")
    with torch.no_grad():
        logits = pv_model(base={"input_ids": ids})[1].logits
    pv_model.save(str(tmp_path / "saved"))
    grad = all(p.requires_grad for p in model.parameters())
    torch.save({"ids": ids, "logits": logits}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import contextlib, io, json, torch, transformers
        torch.set_num_threads({torch.get_num_threads()})  # bit-identity holds per thread count
        with contextlib.redirect_stdout(io.StringIO()):
            import pyvene as pv
        from pyvene_causaltrace import IntervenableModel
        model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'model')!r})
        loaded = IntervenableModel.load({str(tmp_path / 'saved')!r}, model.eval())
        assert type(loaded) is IntervenableModel, type(loaded)
        for parameter in model.parameters():  # as in the saving process: torch folds a matmul
            parameter.requires_grad_({grad})   # differently by this flag, under some threads
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        with torch.no_grad():
            logits = loaded(base={{"input_ids": expected["ids"]}})[1].logits
        names = sorted({{type(v).__name__ for v in loaded.interventions.values()}})
        theirs, refusal = pv.IntervenableModel.load({str(tmp_path / 'saved')!r}, model), ""
        try:
            with torch.no_grad():
                theirs(base={{"input_ids": expected["ids"]}})
        except Exception as error:
            refusal = f"{{type(error).__name__}}: {{error}}"
        print("RESULT " + json.dumps([names, torch.equal(logits, expected["logits"]), refusal]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    names, equal, refusal = json.loads(line.removeprefix("RESULT "))
    return names, equal, refusal
