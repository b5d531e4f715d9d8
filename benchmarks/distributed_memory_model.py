"""The memory model of attribution with a transcoder sharded by feature (docs/attribution.md,
"Beyond one device"), evaluated for Gemma-2-2B with the 2.5M-feature CLT and Qwen3-8B with the
36 x 32k TopK CLT on 8 ranks, and for the run this machine measured
(``benchmarks/distributed_attribution.py``), beside what it measured.

    python benchmarks/distributed_memory_model.py \
        [--measured benchmarks/results/distributed_attribution_resident.json]

Per rank, ``W`` ranks, ``b`` bytes per transcoder element, ``m`` per model weight:

- model: ``n_params * m`` (replicated);
- transcoder slice: ``(L F D + 2 L F + sum_l F T_l D) b / W`` (encoder rows, biases and
  thresholds, decoder rows; ``T_l = L - l`` for a CLT) ``+ L D b`` (``b_dec``, every rank)
  ``+ L D^2 b`` with a skip path; a memory-mapped decoder is read on demand instead;
- forward graph: the active features' decoder and encoder rows of this rank,
  ``sum_l (n_l / W) (T_l + 1) D b``, plus the model's saved activations
  ``24 P L D * 4 + 2 P^2 H L * 4`` (attribution/budget.py's estimate);
- rows in flight: ``batch * (2 g + 8 C + A / 8)``, ``g`` the leaves' bytes (this rank's
  features, ``L P D`` errors, ``P D`` embeddings, float32), ``C = n + (L + 1) P`` columns, ``A``
  the activations above;
- stored rows: ``rows * C * 8`` at most (float32 value + int32 column per entry; every rank
  holds every row).

Bytes moved per row: ``4 n`` (features: each rank's feature columns gathered) or ``4 (C + 1)``
(rows: whole rows gathered); per forward, ``L`` sums of ``P D * 4`` bytes over ranks.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Case:
    name: str
    n_params: float
    model_bytes: int  # per weight
    n_layers: int
    d_model: int
    n_heads: int
    features: int  # per layer
    transcoder_bytes: int  # per element
    cross_layer: bool
    skip: bool
    positions: int
    active_per_position_layer: float
    rows: int  # feature rows stored
    batch: int
    world: int

    def per_rank(self) -> dict[str, float]:
        L, D, F, W, b = (self.n_layers, self.d_model, self.features, self.world,
                         self.transcoder_bytes)
        targets = [L - layer if self.cross_layer else 1 for layer in range(L)]
        encoder = L * F * D + 2 * L * F
        decoder = sum(F * t * D for t in targets)
        whole = (encoder + decoder + L * D + (L * D * D if self.skip else 0)) * b
        slice_ = (encoder + decoder) * b / W + (L * D + (L * D * D if self.skip else 0)) * b
        P = self.positions
        n_layer = self.active_per_position_layer * P
        n = n_layer * L
        forward_rows = sum(n_layer / W * (t + 1) * D * b for t in targets)
        activations = 24 * P * L * D * 4 + 2 * P * P * self.n_heads * L * 4
        columns = n + (L + 1) * P
        leaves = (n / W + L * P * D + P * D) * 4
        in_flight = self.batch * (2 * leaves + 8 * columns + activations / 8)
        stored = self.rows * columns * 8
        model = self.n_params * self.model_bytes
        return {"model": model, "transcoder (whole)": whole, "transcoder slice": slice_,
                "forward: feature rows": forward_rows, "forward: activations": activations,
                "rows in flight": in_flight, "stored rows (at most)": stored,
                "total per rank": model + slice_ + forward_rows + activations + in_flight
                + stored,
                "active features": n, "columns": columns,
                "bytes per row, features split": 4 * n,
                "bytes per row, rows split": 4 * (columns + 1),
                "forward sums": L * P * D * 4}


CASES = [
    Case("Gemma-2-2B, mntss 2.5M CLT (bf16), 8 ranks", 2.614e9, 2, 26, 2304, 8, 98_304, 2,
         True, False, 32, 60, 8_192, 256, 8),
    Case("Qwen3-8B, 36 x 32k joint TopK CLT (fp32), 8 ranks", 8.19e9, 2, 36, 4096, 32, 32_768,
         4, True, False, 32, 28, 8_192, 64, 8),
]
#: The run benchmarks/distributed_attribution.py measured (SmolLM2-135M, fp32, synthetic CLT;
#: 12,283 active features over 9 tokens and 30 layers: position 0, SmolLM2's attention sink,
#: fires far more than the 8 per position the thresholds were calibrated for on the others).
SMOLLM2 = dict(n_params=134.5e6, model_bytes=4, n_layers=30, d_model=576, n_heads=9,
               features=1120, transcoder_bytes=4, cross_layer=True, skip=False,
               positions=9, active_per_position_layer=45.5, rows=1000, batch=32)


def table(case: Case) -> list[str]:
    rows = case.per_rank()
    lines = [f"{case.name}:"]
    for key, value in rows.items():
        if key in ("active features", "columns"):
            lines.append(f"  {key:<32} {value:>14,.0f}")
        elif key.startswith("bytes per row") or key == "forward sums":
            lines.append(f"  {key:<32} {value / 1e3:>11,.1f} kB")
        else:
            lines.append(f"  {key:<32} {value / GB:>11,.2f} GB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, default=None)
    args = parser.parse_args()
    for case in CASES:
        print("\n".join(table(case)))
    if args.measured is not None:
        measured = json.loads(args.measured.read_text())
        for world in sorted({line["world"] for line in measured["ranks"]}):
            case = Case(f"SmolLM2-135M, synthetic CLT, {world} rank(s)", world=world, **SMOLLM2)
            model = case.per_rank()
            print("\n".join(table(case)))
            for line in measured["ranks"]:
                if line["world"] == world:
                    print(f"  measured, {line['mode']}, rank {line['rank']}: transcoder "
                          f"{line['transcoder_mb'] * 2**20 / GB:.3f} GB (model "
                          f"{(model['transcoder slice'] if line['mode'] == 'features' else model['transcoder (whole)']) / GB:.3f}), "  # noqa: E501
                          f"{line['active']} active features (model "
                          f"{model['active features']:.0f}), peak RSS "
                          f"{line['peak_rss_mb'] * 2**20 / GB:.2f} GB")


if __name__ == "__main__":
    main()
