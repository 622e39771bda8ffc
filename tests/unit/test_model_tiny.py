"""Our Llama/Qwen2 model vs HF transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specserve.models.kv_cache import KVCache
from specserve.models.weights import load_llama
from specserve.tree import DraftTree, TreeBatch


def _tiny_hf(tmp_path, model_type="llama", sharded=False, tied=True):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, rope_theta=10000.0)
    if model_type == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**common)).eval()
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    hf.config.save_pretrained(tmp_path)
    if sharded:
        keys = sorted(state)
        half = len(keys) // 2
        shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        for name, ks in shards.items():
            save_file({k: state[k] for k in ks}, tmp_path / name)
        weight_map = {k: name for name, ks in shards.items() for k in ks}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(state, tmp_path / "model.safetensors")
    return hf


def _forward(model, cache, tokens, slot, cache_len, positions=None, mask=None):
    b, t = tokens.shape
    if positions is None:
        positions = torch.arange(cache_len, cache_len + t)[None]
    attn = model.attention_inputs(positions, torch.tensor([slot]), torch.tensor([cache_len]), mask, cache,
                                  [cache_len], [slot])
    return model(tokens, attn, cache)


@pytest.mark.parametrize(("model_type", "sharded", "tied"), [("llama", False, True), ("llama", True, False),
                                                              ("qwen2", False, False)])
def test_logits_match_hf(tmp_path, model_type, sharded, tied):
    hf = _tiny_hf(tmp_path, model_type, sharded, tied)
    model = load_llama(tmp_path, torch.float32)
    model.init_rope(256)
    cache = KVCache(model.cfg, 2, 128, torch.float32, "cpu")
    ids = torch.randint(0, 97, (1, 20))
    with torch.inference_mode():
        ref = hf(ids).logits
        out = _forward(model, cache, ids, slot=1, cache_len=0).logits
    assert (out - ref).abs().max().item() < 1e-4


def test_incremental_decoding_equals_full_forward(tmp_path):
    _tiny_hf(tmp_path)
    model = load_llama(tmp_path, torch.float32)
    model.init_rope(256)
    cache = KVCache(model.cfg, 1, 64, torch.float32, "cpu")
    ids = torch.randint(0, 97, (1, 16))
    with torch.inference_mode():
        full = _forward(model, cache, ids, 0, 0).logits
        _forward(model, cache, ids[:, :10], 0, 0)
        steps = [_forward(model, cache, ids[:, i : i + 1], 0, i).logits for i in range(10, 16)]
    assert torch.allclose(torch.cat(steps, 1), full[:, 10:], atol=1e-5)


def test_tree_attention_equals_each_branch_alone(tmp_path):
    """Every tree node's logits equal those of its root-to-node path decoded as a plain sequence."""
    _tiny_hf(tmp_path)
    model = load_llama(tmp_path, torch.float32)
    model.init_rope(256)
    cache = KVCache(model.cfg, 1, 64, torch.float32, "cpu")
    prefix = torch.randint(0, 97, (1, 8))
    tree = DraftTree.from_parents([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2])
    batch = TreeBatch.from_trees([tree])
    with torch.inference_mode():
        _forward(model, cache, prefix, 0, 0)
        tree_logits = _forward(model, cache, batch.tokens, 0, 8, positions=8 + batch.depth, mask=batch.mask).logits
        for node in range(tree.num_draft_tokens):
            path = [node]
            while tree.parents[path[-1]] >= 0:
                path.append(int(tree.parents[path[-1]]))
            seq = torch.cat([prefix, tree.tokens[path[::-1]][None]], 1)
            alone = _forward(model, cache, seq, 0, 0).logits[0, -1]
            assert torch.allclose(tree_logits[0, node], alone, atol=1e-5), node


def test_missing_or_misshapen_key_is_named(tmp_path):
    from safetensors.torch import load_file

    _tiny_hf(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_llama(tmp_path, torch.float32)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_llama(tmp_path, torch.float32)
