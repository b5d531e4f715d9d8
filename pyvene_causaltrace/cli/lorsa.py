"""Lorsa on the command line: ``fit-lorsa``, and the part of ``attribute --lorsa DIR
[--qk-tracing]`` that loads the set, checks it against the model and traces the kept heads' QK
scores (docs/attribution.md, "Attention features beside head loadings")."""

from __future__ import annotations

from ..attribution.lorsa_qk import trace_lorsa_qk
from ..bound import BoundModel
from ..errors import InputError
from ..lorsa_fitting import LorsaFitSettings, fit_lorsa_set
from ..model_guard import measured
from ..transcoders.lorsa import LorsaSet, check_lorsa_fits, load_lorsa
from .common import resolve_device, settings_of

#: ``fit-lorsa``'s flags that are :class:`LorsaFitSettings` fields, ``{argparse dest: field}``.
FIT_LORSA_FLAGS = {name: name for name in ("model", "layers", "top_k", "per_qk_head", "steps",
                                           "lr", "batch", "length", "texts", "data", "seed")}


def fit_lorsa_settings(args) -> LorsaFitSettings:
    """The settings of ``fit-lorsa``'s flags (a flag left out: the field's default), checked;
    a refusal names the flag."""
    values = {field: getattr(args, dest) for dest, field in FIT_LORSA_FLAGS.items()
              if getattr(args, dest) is not None}
    try:
        values["layers"] = tuple(int(x) for x in str(args.layers).split(",") if x.strip())
    except ValueError:
        raise InputError(f"--layers: give layer numbers separated by commas, got "
                         f"{args.layers!r}") from None
    return settings_of(LorsaFitSettings, values, FIT_LORSA_FLAGS)


def fit_lorsa_command(args) -> int:
    device = resolve_device(args.device)  # a device this machine lacks: refused first
    settings = fit_lorsa_settings(args)  # refused before a model loads
    report = fit_lorsa_set(settings, out=args.out, refit=args.refit, device=device)
    print(report.summary())
    return 0


def load_attention(args, device: str, shard: tuple[int, int] | None = None) -> LorsaSet | None:
    """``--lorsa DIR`` read and checked (its files now, before the model loads; a damaged one
    is refused naming the file and the field), or None without it; ``shard``: this rank's OV
    heads, beside a transcoder sharded by feature (``--split features``)."""
    if args.lorsa is None:
        return None
    return load_lorsa(args.lorsa, device=device, shard=shard)


@measured
def check_attention(model: BoundModel, lorsa: LorsaSet | None) -> None:
    """A Lorsa of another model or of a layer the model lacks: refused before the graph."""
    if lorsa is not None:
        check_lorsa_fits(model, lorsa)


def qk_tracing(args, model, transcoder, lorsa: LorsaSet | None, graph, pruned) -> list[dict]:
    """``--qk-tracing``: the kept Lorsa nodes' QK tracing, kept in the graph's metadata (the
    graph JSON writes it); ``[]`` without the flag."""
    if not getattr(args, "qk_tracing", False):
        return []
    kept = pruned.node_mask.nonzero().squeeze(-1).tolist()
    nodes = [int(i) for i in kept if graph.node_kind(int(i)) == "lorsa"]
    results = trace_lorsa_qk(model, transcoder, lorsa, graph, nodes)
    print(f"qk tracing: {len(results)} kept Lorsa heads traced")
    return results
