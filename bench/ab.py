"""Before/after: `specserve bench` on two revisions of this repository, interleaved on one machine.

    python bench/ab.py BEFORE [AFTER] --rounds 2 --out results/ab -- --algorithm ngram,eagle3 --no-adaptive

Each revision runs from a git worktree of its own (under `<out>/trees`, sharing this checkout's
`models/`); AFTER defaults to this checkout as it is. The runs alternate in ABBA order (A B, B A,
A B, ...), so a drift of the machine weighs on both sides alike. Everything after `--` goes to
`specserve bench` (`--json` is set here). Writes `<out>/<side><n>.json` per run and
`<out>/summary.json`: per method (`none` is each run's baseline) the tokens per second of every
run, their means and after/before, with the CPU's flags. It prints the table too.

On a busy machine the figures mean little: run nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

from specserve.hardware import cpu_flags  # noqa: E402 - after the path above

FLAGS_NOTED = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def order(rounds: int) -> list[str]:
    """The sides in ABBA order: rounds A-B pairs, every second one reversed."""
    sides: list[str] = []
    for i in range(rounds):
        sides += ["before", "after"] if i % 2 == 0 else ["after", "before"]
    return sides


def tokens_per_s(report: dict) -> dict[str, float]:
    """Per method, a `specserve bench` report's tokens per second (`none`: its baseline)."""
    return {"none": report["baseline_tokens_per_s"],
            **{name: run["tokens_per_s"] for name, run in report["runs"].items()}}


def summarize(before: Sequence[dict], after: Sequence[dict]) -> dict[str, dict]:
    """Per method: every run's tokens per second, the means and after / before."""
    rows: dict[str, dict] = {}
    for method in tokens_per_s(before[0]):
        b = [tokens_per_s(r)[method] for r in before]
        a = [tokens_per_s(r)[method] for r in after]
        rows[method] = {"before": b, "after": a, "before_mean": round(statistics.mean(b), 2),
                        "after_mean": round(statistics.mean(a), 2),
                        "ratio": round(statistics.mean(a) / statistics.mean(b), 3)}
    return rows


def worktree(rev: str, trees: Path) -> Path:
    """A worktree of `rev` (made once) whose models/ is this checkout's."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    tree = trees / commit[:12]
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree), commit], check=True)
    if not (tree / "models").exists():
        (tree / "models").symlink_to(REPO / "models")
    return tree


def run_bench(tree: Path, bench_args: Sequence[str], json_path: Path) -> dict:
    """`specserve bench` from `tree`'s own sources, with this interpreter's packages."""
    env_path = ":".join(str(tree / d) for d in ("backend", "kernels", "client"))
    cmd = [sys.executable, "-c", "import sys; from specserve.cli import main; sys.exit(main())",
           "bench", *bench_args, "--json", str(json_path)]
    subprocess.run(cmd, check=True, cwd=tree, env={**os.environ, "PYTHONPATH": env_path})
    return json.loads(json_path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before", help="a git revision")
    p.add_argument("after", nargs="?", default=None, help="a git revision (default: this checkout as it is)")
    p.add_argument("--rounds", type=int, default=2, help="runs per side (default: %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "ab")
    args = p.parse_args(own)
    args.out = args.out.resolve()  # the runs write from their own worktrees
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"before": worktree(args.before, args.out / "trees"),
             "after": REPO if args.after is None else worktree(args.after, args.out / "trees")}
    reports: dict[str, list[dict]] = {"before": [], "after": []}
    for side in order(args.rounds):
        n = len(reports[side]) + 1
        reports[side].append(run_bench(trees[side], bench_args, args.out / f"{side}{n}.json"))
    rows = summarize(reports["before"], reports["after"])
    summary = {"before": args.before, "after": args.after or "working tree", "bench_args": bench_args,
               "order": order(args.rounds), "cpu_flags": sorted(cpu_flags() & set(FLAGS_NOTED)), "methods": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'method':12} {'before':>9} {'after':>9} {'ratio':>6}   CPU flags: {' '.join(summary['cpu_flags'])}")
    for method, row in rows.items():
        print(f"{method:12} {row['before_mean']:9.2f} {row['after_mean']:9.2f} {row['ratio']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
