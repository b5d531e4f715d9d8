"""The unembedding's matrix product into fresh memory (``F.linear``, what a model's head does)
against into one reused buffer (``torch.mm(..., out=)``, what ``tracing/head.py`` does), for
SmolLM2's head (49,152 × 576) at a trace chunk's row counts, interleaved, in G multiply-adds/s.

    python benchmarks/head_buffer.py [--threads 2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VOCAB, HIDDEN = 49152, 576


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    weight = torch.randn(VOCAB, HIDDEN)
    print(f"torch threads {torch.get_num_threads()}; median of {args.repeats} calls each")
    print(f"{'rows':>6} {'fresh GMAC/s':>13} {'reused GMAC/s':>14} {'same bits':>10}")
    for rows in (64, 290, 580, 1160):
        x = torch.randn(rows, HIDDEN)
        buffer = torch.empty(rows, VOCAB)
        fresh, reused = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plain = torch.nn.functional.linear(x, weight)
            fresh.append(time.perf_counter() - start)
            del plain
            start = time.perf_counter()
            torch.mm(x, weight.t(), out=buffer)
            reused.append(time.perf_counter() - start)
        same = torch.equal(buffer, torch.nn.functional.linear(x, weight))
        macs = rows * HIDDEN * VOCAB / 1e9
        print(f"{rows:>6} {macs / statistics.median(fresh):>13.1f} "
              f"{macs / statistics.median(reused):>14.1f} {str(same):>10}")


if __name__ == "__main__":
    main()
