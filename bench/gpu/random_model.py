"""A model directory with random weights in a given shape (SmolLM2-135M's by default), so the GPU
check's first call needs no staged checkpoint: the shapes, kernels, CUDA graphs, capture and
losslessness it checks are the real ones; its tokens per second are the real model's (same shape,
same work per token); its accept lengths and text are not (random weights agree with no drafter).

The tokenizer and chat template are copied from `--tokenizer-from` (default: the prepared
SmolLM2, where it is and its ids fit the shape's vocabulary); otherwise a word-level tokenizer over
the shape's vocabulary is written, with a ChatML template. The served drafters (committed under
model_repository/) fit SmolLM2's shape. Writes config.json, generation_config.json,
model.safetensors (bf16), the tokenizer files.

    python bench/gpu/random_model.py OUT_DIR [--shape smollm2-135m] [--layers N] [--tokenizer-from DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import SHAPES  # noqa: E402 - bench/gpu's shapes

from specserve.model_config import ModelConfig  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")
BOS, EOS = 1, 2


def hf_config(cfg: ModelConfig) -> dict:
    """The HF LlamaConfig fields of a shape."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": BOS, "eos_token_id": EOS,
            "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
            "specserve_random_weights": True}  # what the GPU tests read: drafts are rarely accepted


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the shape under its HF name, bf16: N(0, 0.02) matrices, unit norms."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    ones = torch.ones(h, dtype=torch.bfloat16)
    w = {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "model.norm.weight": ones}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = normal(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        w |= {p + "self_attn.q_proj.weight": normal(cfg.num_heads * d, h),
              p + "self_attn.k_proj.weight": normal(cfg.num_kv_heads * d, h),
              p + "self_attn.v_proj.weight": normal(cfg.num_kv_heads * d, h),
              p + "self_attn.o_proj.weight": normal(h, cfg.num_heads * d),
              p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
              p + "mlp.down_proj.weight": normal(h, i),
              p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone()}
    return w


def word_level_tokenizer(vocab_size: int) -> str:
    """tokenizer.json of a word-level tokenizer with ids 0..vocab_size-1 (`<unk>`, `<s>`, `</s>`,
    ChatML's two markers, then `w4`, `w5`, ...), splitting on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: n for n, t in enumerate(special)} | {f"w{n}": n for n in range(len(special), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    return tok.to_str()


def fits(tokenizer_file: Path, vocab_size: int) -> bool:
    """Whether a tokenizer file is there and its ids fall inside the shape's vocabulary."""
    from tokenizers import Tokenizer

    return tokenizer_file.is_file() and Tokenizer.from_file(str(tokenizer_file)).get_vocab_size() <= vocab_size


def write(out: Path, cfg: ModelConfig, tokenizer_from: Path | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}) + "\n")
    save_file(random_weights(cfg), str(out / "model.safetensors"))
    if tokenizer_from is not None and fits(tokenizer_from / "tokenizer.json", cfg.vocab_size):
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, out / name)
    else:
        (out / "tokenizer.json").write_text(word_level_tokenizer(cfg.vocab_size))
        (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "unk_token": "<unk>",
                                                               "tokenizer_class": "PreTrainedTokenizerFast"}))
        (out / "chat_template.jinja").write_text(CHATML)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    p.add_argument("--tokenizer-from", default=None, help="a model directory whose tokenizer files to copy")
    args = p.parse_args(argv)
    cfg = SHAPES[args.shape] if args.layers is None else replace(SHAPES[args.shape], num_layers=args.layers)
    source = args.tokenizer_from
    if source is None:
        from specserve.prepare import default_model_dir

        source = default_model_dir()
    print(write(Path(args.out), cfg, Path(source) if source else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
