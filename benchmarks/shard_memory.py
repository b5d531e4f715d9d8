"""Memory per rank of a transcoder sharded by feature (issue 41): a synthetic mntss CLT of about
1.2 GB (float32, 12 layers, d_model 256, 13,000 features per layer) loaded whole and as each
shard of ``--world`` (default 2), with resident decoders (``lazy_decoder=False``) and with
memory-mapped ones (``lazy_decoder=True``).

    python benchmarks/shard_memory.py                      # a temporary directory, removed after
    python benchmarks/shard_memory.py --dir /tmp/shard_clt --json shard_memory.json   # kept

Each load runs in a fresh process (``python benchmarks/shard_memory.py --measure ...``) so its
memory is its own. Per process: ``resident_bytes()`` (what the Transcoder holds; a mapped decoder
counts 0), its fraction of the whole's in the same decoder mode, the process's resident set
before the load (torch and the package imported), its peak (``ru_maxrss``: anonymous memory and
the file pages it touched, which here are in the page cache because the files were just
written), the anonymous resident set after the load, and the load's seconds. The CLT is written
one layer at a time (at most one layer's decoder in memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package first
N_LAYERS, D_MODEL, D_TRANSCODER = 12, 256, 13_000  # 13,000 x 256 x (12 + 78) x 4 B = 1.20 GB
MB = 2**20


def write(path: Path, n_layers: int, d_model: int, d_transcoder: int) -> int:
    """A random mntss JumpReLU CLT, one layer at a time; returns its bytes on disk."""
    import yaml  # only the writer needs it
    from safetensors.torch import save_file  # likewise

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for layer in range(n_layers):
        save_file({f"W_enc_{layer}": torch.randn(d_transcoder, d_model, generator=g) * 0.06,
                   f"b_enc_{layer}": torch.zeros(d_transcoder),
                   f"b_dec_{layer}": torch.zeros(d_model),
                   f"threshold_{layer}": torch.full((d_transcoder,), 0.5)},
                  str(path / f"W_enc_{layer}.safetensors"))
        dec = torch.empty(d_transcoder, n_layers - layer, d_model).normal_(generator=g)
        save_file({f"W_dec_{layer}": dec}, str(path / f"W_dec_{layer}.safetensors"))
        del dec
    (path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "synthetic", "model_kind": "cross_layer_transcoder",
        "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out"}))
    return sum(file.stat().st_size for file in path.iterdir())


def _status_kb(field: str) -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status[field].split()[0])


def measure(path: str, rank: int, world: int, lazy: bool) -> dict:
    """One load in this process (``world`` 0: the whole transcoder)."""
    from pyvene_causaltrace.transcoders import load_transcoder  # imported before the baseline

    before = _status_kb("VmRSS")
    start = time.perf_counter()
    tc = load_transcoder(path, lazy_decoder=lazy, shard=None if world == 0 else (rank, world))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"what": "whole" if world == 0 else f"shard {rank}/{world}",
            "lazy_decoder": lazy, "features": list(tc.features or (0, tc.cfg.d_transcoder)),
            "resident_bytes": tc.resident_bytes(), "rss_before_kib": before,
            "peak_rss_kib": peak, "anon_after_kib": _status_kb("RssAnon"), "load_s": seconds,
            "package": str(Path(sys.modules["pyvene_causaltrace"].__file__).parent)}


def run_one(path: Path, rank: int, world: int, lazy: bool) -> dict:
    done = subprocess.run([sys.executable, __file__, "--measure", str(path), str(rank),
                           str(world), str(int(lazy))], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"measuring rank {rank} of {world} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="write (or reuse) the CLT here and keep it")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the table here")
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        path, rank, world, lazy = args.measure
        print(json.dumps(measure(path, int(rank), int(world), bool(int(lazy)))))
        return
    temporary = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="shard_memory_")) if temporary else args.dir
    try:
        path = root / "clt"
        start = time.perf_counter()
        if (path / "config.yaml").exists():
            size = sum(file.stat().st_size for file in path.iterdir())
            print(f"reusing {path} ({size / 2**30:.2f} GiB)")
        else:
            size = write(path, N_LAYERS, D_MODEL, D_TRANSCODER)
            print(f"wrote {path}: {N_LAYERS} layers x {D_TRANSCODER} features, d_model "
                  f"{D_MODEL}, float32, {size / 2**30:.2f} GiB in "
                  f"{time.perf_counter() - start:.1f} s")
        rows = []
        for lazy in (False, True):
            whole = run_one(path, 0, 0, lazy)
            rows.append(whole)
            rows += [run_one(path, rank, args.world, lazy) for rank in range(args.world)]
            for row in rows[-args.world - 1:]:
                row["fraction_of_whole"] = row["resident_bytes"] / whole["resident_bytes"]
        print(f"{'load':>12} {'decoder':>9} {'features':>14} {'resident MB':>12} {'fraction':>9} "
              f"{'RSS before MB':>14} {'peak RSS MB':>12} {'peak-before':>12} "
              f"{'anon after MB':>14} {'load s':>7}")
        for row in rows:
            lo, hi = row["features"]
            print(f"{row['what']:>12} {'mapped' if row['lazy_decoder'] else 'resident':>9} "
                  f"{f'[{lo}, {hi})':>14} {row['resident_bytes'] / MB:>12.1f} "
                  f"{row['fraction_of_whole']:>9.3f} {row['rss_before_kib'] / 1024:>14.0f} "
                  f"{row['peak_rss_kib'] / 1024:>12.0f} "
                  f"{(row['peak_rss_kib'] - row['rss_before_kib']) / 1024:>12.0f} "
                  f"{row['anon_after_kib'] / 1024:>14.0f} {row['load_s']:>7.2f}")
        if args.json:
            args.json.write_text(json.dumps({
                "shape": {"n_layers": N_LAYERS, "d_model": D_MODEL,
                          "d_transcoder": D_TRANSCODER, "dtype": "float32", "bytes": size},
                "world": args.world, "rows": rows}, indent=1))
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
