"""The standalone drafter's draft time per drafting step with its compiled program against eager, in one
process, alternating rounds, pinned shape (3 steps, topk 1, 4 tokens), the served default target.

    .venv/bin/python bench/standalone_compiled.py [OUT.json]
"""

import json
import sys

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.profile import StepProfile
from specserve.hardware import describe
from specserve.prepare import prepare
from specserve.prompts import load_questions, render_chat

d = str(prepare())
eng = Engine(EngineConfig(model_dir=d, device="cpu", max_batch_size=1, serve_while_compiling=False,
                          spec=SpecConfig(algorithm="standalone", num_steps=3, topk=1, num_draft_tokens=4)))
prompts = [eng.tokenizer.encode(render_chat(d, q), add_special_tokens=False).ids for q in load_questions("mtbench", 6)]
program = eng.drafter.runner.compiled
assert program is not None
params = SamplingParams(max_tokens=64, ignore_eos=True)
eng.generate(prompts[:1], params)
res = {"compiled": [], "eager": []}
for rnd in range(4):
    for mode in (("compiled", "eager") if rnd % 2 == 0 else ("eager", "compiled")):
        eng.drafter.runner.compiled = program if mode == "compiled" else None
        eng.profile = StepProfile()
        eng.generate(prompts, params)
        p = eng.profile
        res[mode].append((p.draft / p.drafting_steps * 1e3, p.draft_model / p.draft_forwards * 1e3,
                          p.total / p.steps * 1e3))
out = {m: {"draft_ms_per_drafting_step": round(sum(r[0] for r in v) / len(v), 3),
           "draft_model_ms_per_forward": round(sum(r[1] for r in v) / len(v), 3),
           "step_ms": round(sum(r[2] for r in v) / len(v), 3), "rounds": v} for m, v in res.items()}
out["hardware"] = describe()
print(json.dumps(out, indent=1))
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
