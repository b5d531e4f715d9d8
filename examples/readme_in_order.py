"""Run the README as a newcomer would, on the real model: every fenced block after the Quickstart,
in order, each Python block in a fresh interpreter (as if pasted into a new session), each shell
command as typed, with its wall time. Run it from the root of a clone, after ``make setup``:

    python examples/readme_in_order.py --record examples/results/readme_in_order.json
    python examples/readme_in_order.py --known-1000 ../shared/data/known_1000.json   # offline

``make test`` is left out (the suite; docs/testing.md times it); ``serve`` is started, its
listing fetched once, then stopped; a ``NAME=value`` line sets ``$NAME`` for the lines after it,
as in the shell the block is pasted into. Every command runs even after one fails; the exit status
is 1 when any failed. Outputs land where the README says (``graph.json``, ``out/``, ``runs/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

FENCE = re.compile(r"```(python|bash)\n(.*?)```", re.S)
URL = re.compile(r"http://127\.0\.0\.1:\d+/")


def blocks(readme: str) -> list[tuple[str, str]]:
    """The (language, text) of each fenced block from the Quickstart on."""
    return FENCE.findall(readme[readme.index("## Quickstart"):])


def commands(script: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", script)
    found = []
    for line in joined.splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command and not command.startswith("#"):
            found.append(command)
    return found


def run_serve(command: str, env: dict) -> tuple[int, str]:
    """Start ``serve``, fetch its listing once, stop it: (exit status, what it listed)."""
    process = subprocess.Popen(["bash", "-c", f"exec {command} --no-open"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
        found = URL.search(line)
        if found is None:
            return 1, line.strip()
        with urllib.request.urlopen(found.group(0) + "api/listing", timeout=30) as response:
            listing = json.loads(response.read())
        names = [entry["name"] for entry in listing]
        return (0 if names else 1), f"listed {names}"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    parser.add_argument("--record", type=Path, default=None, help="write the steps' times here")
    parser.add_argument("--known-1000", type=Path, default=None,
                        help="a local copy of ROME's known_1000.json (sets $PVCT_KNOWN_1000)")
    args = parser.parse_args()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    if args.known_1000 is not None:
        env["PVCT_KNOWN_1000"] = str(args.known_1000.resolve())
    steps = []
    for index, (language, text) in enumerate(blocks(args.readme.read_text())):
        if language == "python":
            todo = [("python", text, [sys.executable, "-c", text])]
        else:
            todo = [("bash", c, ["bash", "-c", c]) for c in commands(text)]
        for kind, shown, argv in todo:
            first = shown.strip().splitlines()[0] if kind == "python" else shown
            if shown.strip() == "make test":
                steps.append({"block": index, "kind": kind, "command": first,
                              "skipped": "the suite (docs/testing.md times it)"})
                continue
            print(f"=== block {index} ({kind}): {first[:100]}", flush=True)
            start = time.perf_counter()
            assignment = re.fullmatch(r"(\w+)=(\S+)", shown) if kind == "bash" else None
            if assignment:  # a shell variable the block's later lines read: kept, ~ expanded
                env[assignment[1]] = subprocess.run(
                    ["bash", "-c", f"echo {assignment[2]}"], env=env, capture_output=True,
                    text=True, check=True).stdout.strip()
                code = 0
            elif kind == "bash" and " serve " in f" {shown} ":
                code, said = run_serve(shown, env)
                print(said, flush=True)
            else:
                code = subprocess.run(argv, env=env).returncode
            seconds = round(time.perf_counter() - start, 1)
            print(f"=== block {index}: exit {code} after {seconds} s", flush=True)
            steps.append({"block": index, "kind": kind, "command": first, "exit": code,
                          "seconds": seconds})
    failed = [s for s in steps if s.get("exit")]
    summary = {"steps": steps, "failed": len(failed),
               "seconds": round(sum(s.get("seconds", 0) for s in steps), 1)}
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{len(steps)} steps, {len(failed)} failed, {summary['seconds']} s in all")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
