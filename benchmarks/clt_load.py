"""Load time and resident memory of a synthetic CLT, lazy (mmapped) vs eager decoder, as the
decoder grows; and reconstruction time per token, sparse (gather the fired rows) vs dense.

    python benchmarks/clt_load.py --dir /tmp/clt_bench      # writes up to ~3 GB there

Each measurement runs in a fresh subprocess so that resident memory is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

MEASURE = r'''
import json, sys, time, torch
from pyvene_causaltrace.clt import load_from_disk
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
path, lazy = sys.argv[1], sys.argv[2] == "lazy"
base = rss(); start = time.perf_counter()
clt = load_from_disk(path, lazy_decoder=lazy)
load_s = time.perf_counter() - start
loaded = rss() - base
g = torch.Generator().manual_seed(0)
P = 16
acts = torch.zeros(clt.n_layers, P, clt.cfg.d_transcoder)
for layer in range(clt.n_layers):  # ~12 features per layer and position, as real CLTs
    for p in range(1, P):
        ids = torch.randint(0, clt.cfg.d_transcoder, (12,), generator=g)
        acts[layer, p, ids] = torch.rand(12, generator=g) + 0.5
start = time.perf_counter(); recon = clt.reconstruct(acts); sparse_s = time.perf_counter() - start
dense_s = None
if not lazy:  # dense reference: every decoder row multiplied, whether it fired or not
    start = time.perf_counter()
    out = clt.b_dec[:, None].expand(clt.n_layers, P, -1).clone()
    for s in range(clt.n_layers):
        for t in range(s, clt.n_layers):
            out[t] += acts[s] @ clt.W_dec[s][:, t - s]
    dense_s = time.perf_counter() - start
    assert torch.allclose(out, recon, atol=1e-4)
print(json.dumps({"load_s": load_s, "rss_mb": loaded, "after_recon_mb": rss() - base,
                  "sparse_ms_per_token": 1000 * sparse_s / P,
                  "dense_ms_per_token": None if dense_s is None else 1000 * dense_s / P}))
'''


def write(path: Path, n_layers: int, d_transcoder: int, d_model: int) -> float:
    import yaml
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    size = 0
    for layer in range(n_layers):
        save_file({f"W_enc_{layer}": torch.randn(d_transcoder, d_model, generator=g,
                                                 dtype=torch.float32).bfloat16(),
                   f"b_enc_{layer}": torch.zeros(d_transcoder, dtype=torch.bfloat16),
                   f"b_dec_{layer}": torch.zeros(d_model, dtype=torch.bfloat16),
                   f"threshold_{layer}": torch.ones(d_transcoder, dtype=torch.bfloat16)},
                  str(path / f"W_enc_{layer}.safetensors"))
        dec = torch.empty(d_transcoder, n_layers - layer, d_model, dtype=torch.bfloat16)
        dec.normal_(generator=g)
        save_file({f"W_dec_{layer}": dec}, str(path / f"W_dec_{layer}.safetensors"))
        size += dec.numel() * 2
        del dec
    (path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "synthetic", "model_kind": "cross_layer_transcoder",
        "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out"}))
    return size / 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/clt_bench"))
    parser.add_argument("--widths", default="2048,8192,16384")
    args = parser.parse_args()
    print(f"{'decoder GB':>10} {'mode':>6} {'load s':>8} {'RSS MB':>8} {'RSS after recon':>16} "
          f"{'sparse ms/tok':>14} {'dense ms/tok':>13}")
    for width in map(int, args.widths.split(",")):
        path = args.dir / f"w{width}"
        gb = write(path, n_layers=8, d_transcoder=width, d_model=2048)
        for mode in ("lazy", "eager"):
            done = subprocess.run([sys.executable, "-c", MEASURE, str(path), mode],
                                  capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            dense = "-" if r["dense_ms_per_token"] is None else f"{r['dense_ms_per_token']:.2f}"
            print(f"{gb:>10.2f} {mode:>6} {r['load_s']:>8.2f} {r['rss_mb']:>8.0f} "
                  f"{r['after_recon_mb']:>16.0f} {r['sparse_ms_per_token']:>14.2f} {dense:>13}")
        for file in path.iterdir():
            file.unlink()
        path.rmdir()


if __name__ == "__main__":
    main()
