"""Load time and resident memory of a synthetic CLT, lazy (mmapped) vs eager decoder, as the
decoder grows; and reconstruction time per token, sparse (gather the fired rows) vs dense.

    python benchmarks/clt_load.py --dir /tmp/clt_bench      # writes up to ~3 GB there

Each measurement runs in a fresh subprocess so that resident memory is its own. Memory is the
process's anonymous resident set (what it allocated); pages of the memory-mapped decoder that the
kernel maps in (page cache, droppable, and here mapped generously because the file was just
written) are shown apart.
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
from pyvene_causaltrace.transcoders import load_from_disk
def rss():
    # anonymous resident memory: what the process allocated (file-backed pages of a memory
    # map are page cache the kernel may drop; they are reported apart as file_mb)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["RssAnon"].split()[0]) / 1024
def file_mb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["RssFile"].split()[0]) / 1024
path, mode = sys.argv[1], sys.argv[2]
lazy = mode != "eager"
base = rss(); start = time.perf_counter()
clt = load_from_disk(path, lazy_decoder=lazy, lazy_encoder=mode == "lazy+stream")
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
                  "file_mb": file_mb(),
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
    print(f"{'decoder GB':>10} {'mode':>11} {'load s':>8} {'anon MB':>8} {'anon after recon':>17} "
          f"{'mapped file MB':>15} {'sparse ms/tok':>14} {'dense ms/tok':>13}")
    for width in map(int, args.widths.split(",")):
        path = args.dir / f"w{width}"
        gb = write(path, n_layers=8, d_transcoder=width, d_model=2048)
        for mode in ("lazy+stream", "lazy", "eager"):
            done = subprocess.run([sys.executable, "-c", MEASURE, str(path), mode],
                                  capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            dense = "-" if r["dense_ms_per_token"] is None else f"{r['dense_ms_per_token']:.2f}"
            print(f"{gb:>10.2f} {mode:>11} {r['load_s']:>8.2f} {r['rss_mb']:>8.0f} "
                  f"{r['after_recon_mb']:>17.0f} {r['file_mb']:>15.0f} "
                  f"{r['sparse_ms_per_token']:>14.2f} {dense:>13}")
        for file in path.iterdir():
            file.unlink()
        path.rmdir()


if __name__ == "__main__":
    main()
