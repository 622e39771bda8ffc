"""Which target the engine serves: `load_target` reads the GGUF's own blocks or the safetensors
checkpoint, as `load_format` says; `eos_ids` are the tokens that end its output. This module
decides nothing about formats (`hardware.auto_load_format` does) and runs no model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specserve.config import EngineConfig
from specserve.model_config import ModelConfig
from specserve.models.gguf import load_llama_gguf
from specserve.models.llama import LlamaModel
from specserve.models.weights import load_llama
from specserve_kernels.gguf_gemm import ACTIVATION_DIGITS

log = logging.getLogger(__name__)


def load_target(config: EngineConfig) -> LlamaModel:
    """The target as `load_format` says: the GGUF's blocks, or the checkpoint at `dtype` (also
    where the GGUF kernel could not be built: float32 then, with a warning)."""
    if config.load_format == "gguf":
        try:
            return load_llama_gguf(config.model_dir, digits=ACTIVATION_DIGITS[config.gguf_activations])
        except RuntimeError as e:
            log.warning("%s; serving the safetensors checkpoint in float32 instead", e)
    return load_llama(config.model_dir, config.torch_dtype, config.device)


def eos_ids(model_dir: str, model_config: ModelConfig) -> tuple[int, ...]:
    """The model's EOS tokens: its config's and its generation config's."""
    ids = set(model_config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
