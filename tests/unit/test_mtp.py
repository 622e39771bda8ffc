"""MTP heads in both published layouts (DeepSeek-V3 NextN, Xiaomi MiMo) on tiny checkpoints that
sit inside the target's own directory, as they ship; drafting with them is lossless."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.models.llama import rope_table
from specserve.models.mtp_head import load_mtp, save_mtp
from specserve.models.weights import load_llama

H, HEADS, KV, INTER, LAYERS, VOCAB = 64, 4, 2, 128, 8, 49152  # as tiny_target_dir


def with_mtp_head(src, dst, layout, own_head=False, drop=None):
    """Copy the tiny target and add one MTP head under the layout's published key names."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    with safe_open(dst / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    d = H // HEADS
    layer = {"self_attn.q_proj.weight": rnd(HEADS * d, H), "self_attn.k_proj.weight": rnd(KV * d, H),
             "self_attn.v_proj.weight": rnd(KV * d, H), "self_attn.o_proj.weight": rnd(H, HEADS * d),
             "mlp.gate_proj.weight": rnd(INTER, H), "mlp.up_proj.weight": rnd(INTER, H),
             "mlp.down_proj.weight": rnd(H, INTER), "input_layernorm.weight": 1 + rnd(H),
             "post_attention_layernorm.weight": 1 + rnd(H)}
    if layout == "deepseek":
        p = f"model.layers.{LAYERS}."
        head = {"enorm.weight": 1 + rnd(H), "hnorm.weight": 1 + rnd(H), "eh_proj.weight": rnd(H, 2 * H),
                "shared_head.norm.weight": 1 + rnd(H)}
        if own_head:
            head["shared_head.head.weight"] = rnd(VOCAB, H)
    else:
        p = "model.mtp_layers.0."
        head = {"token_layernorm.weight": 1 + rnd(H), "hidden_layernorm.weight": 1 + rnd(H),
                "input_proj.weight": rnd(H, 2 * H), "final_layernorm.weight": 1 + rnd(H)}
    tensors |= {p + k: v for k, v in (layer | head).items()}
    if drop:
        tensors.pop(p + drop)
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_llama(tiny_target_dir, torch.float32)


def _dense(head, n):
    rope = rope_table(head.cfg.layer_config(), n, torch.float32)

    def attend(attn, x):
        q, k, v = attn.project(x, rope[0][None, :, None], rope[1][None, :, None])
        o = torch.nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                             enable_gqa=True)
        return attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))

    return attend


@pytest.mark.parametrize(("layout", "own_head"), [("deepseek", False), ("deepseek", True), ("mimo", False)])
def test_loads_both_layouts_from_the_target_dir(tmp_path, tiny_target_dir, target, layout, own_head):
    path = with_mtp_head(tiny_target_dir, tmp_path / "t", layout, own_head)
    head = load_mtp(path, target, torch.float32)
    assert head.cfg.layout == layout and (head.head is not None) == own_head
    assert head.logits(torch.randn(2, H)).shape == (2, VOCAB)
    # the concatenation order is the layout's: MiMo puts the hidden state first
    tokens, hidden = torch.randint(0, VOCAB, (1, 4)), torch.randn(1, 4, H)
    e = head.token_norm(target.embed_tokens(tokens))
    hn = head.hidden_norm(hidden)
    parts = [e, hn] if layout == "deepseek" else [hn, e]
    x = head.proj(torch.cat(parts, -1))
    assert torch.allclose(head(tokens, hidden, lambda attn, y: torch.zeros_like(y)),
                          x + head.layer.mlp(head.layer.post_attention_layernorm(x)), atol=1e-6)


def test_no_head_or_missing_key_is_named(tmp_path, tiny_target_dir, target):
    with pytest.raises(KeyError, match="no MTP head"):
        load_mtp(tiny_target_dir, target, torch.float32)
    path = with_mtp_head(tiny_target_dir, tmp_path / "t", "deepseek", drop="hnorm.weight")
    with pytest.raises(KeyError, match=rf"model\.layers\.{LAYERS}\.hnorm\.weight"):
        load_mtp(path, target, torch.float32)


def test_save_load_round_trip(tmp_path, tiny_target_dir, target):
    head = load_mtp(with_mtp_head(tiny_target_dir, tmp_path / "t", "mimo"), target, torch.float32)
    again = load_mtp(save_mtp(head, tmp_path / "saved", dtype=torch.float32), target, torch.float32)
    assert again.cfg.layout == "deepseek"  # we save DeepSeek's layout; MiMo's order is then not kept
    tokens, hidden = torch.randint(0, VOCAB, (1, 5)), torch.randn(1, 5, H)
    ds = load_mtp(with_mtp_head(tiny_target_dir, tmp_path / "d", "deepseek"), target, torch.float32)
    again = load_mtp(save_mtp(ds, tmp_path / "saved2", dtype=torch.float32), target, torch.float32)
    assert torch.equal(ds(tokens, hidden, _dense(ds, 5)), again(tokens, hidden, _dense(again, 5)))


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (3, 2, 6)])
def test_mtp_drafting_is_lossless(tmp_path, tiny_target_dir, steps, topk, ndt):
    path = with_mtp_head(tiny_target_dir, tmp_path / "t", "deepseek")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 19, 12)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def engine(**spec):
        return Engine(EngineConfig(model_dir=str(path), device="cpu", dtype="float32", cpu_compile=False,
                                   max_batch_size=2, max_seq_len=256, spec=SpecConfig(**spec)))

    ref = engine().generate(prompts, params)
    outs = engine(algorithm="mtp", num_steps=steps, topk=topk, num_draft_tokens=ndt).generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(o.num_draft_tokens > 0 for o in outs)
