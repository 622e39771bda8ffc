"""The served llm model with a fault injected on demand, for the health tests (copied into a test
repository as `<model>/1/model.py`; not a test module).

Two config.pbtxt parameters, removed before the real model sees its config:
  fault_file: once this file exists, the patched engine method raises;
  fault_in:   "step" (Engine.step: a failed step) or "loop" (Engine.has_work: an exception outside
              a step, which ends the engine thread).
The patch is on the `Engine` class of this model's own stub process, so no other model is touched.
"""

from __future__ import annotations

import json
import os
from typing import Any

from specserve.engine.engine import Engine
from specserve.serving.triton_model import TritonPythonModel as ServedModel

METHODS = {"step": "step", "loop": "has_work"}


def inject(method: str, trigger: str) -> None:
    original = getattr(Engine, method)

    def faulty(engine: Engine, *args: Any, **kwargs: Any) -> Any:
        if os.path.exists(trigger):
            raise RuntimeError(f"injected fault in Engine.{method}")
        return original(engine, *args, **kwargs)

    setattr(Engine, method, faulty)


class TritonPythonModel(ServedModel):
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = config["parameters"]
        trigger = params.pop("fault_file")["string_value"]
        inject(METHODS[params.pop("fault_in")["string_value"]], trigger)
        super().initialize({**args, "model_config": json.dumps(config)})
