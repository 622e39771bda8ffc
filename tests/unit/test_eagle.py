"""EAGLE-1/2 and EAGLE-3 heads on tiny random checkpoints written with the published key names;
HeadDrafter in the engine (lossless, cache refresh) and its agreement with the training unroll."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.models.eagle_head import load_eagle, save_eagle
from specserve.models.kv_cache import KVCache
from specserve.models.llama import rope_table
from specserve.models.weights import load_llama
from specserve.training.features import target_features
from specserve.training.train_drafter import ttt_losses
from specserve_kernels import gguf_gemm

H, HEADS, KV, INTER, LAYERS, VOCAB, DRAFT_VOCAB = 64, 4, 2, 128, 8, 49152, 512  # as tiny_target_dir


def write_checkpoint(path, algorithm, aux=None, drop=None, bad_shape=None, fc_bias=False):
    """A random draft head under exactly the published key names."""
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    src = "midlayer." if algorithm == "eagle3" else "layers.0."
    attn_in = 2 * H if algorithm == "eagle3" else H
    d = H // HEADS
    t = {
        f"{src}self_attn.q_proj.weight": rnd(HEADS * d, attn_in),
        f"{src}self_attn.k_proj.weight": rnd(KV * d, attn_in),
        f"{src}self_attn.v_proj.weight": rnd(KV * d, attn_in),
        f"{src}self_attn.o_proj.weight": rnd(H, HEADS * d),
        f"{src}mlp.gate_proj.weight": rnd(INTER, H),
        f"{src}mlp.up_proj.weight": rnd(INTER, H),
        f"{src}mlp.down_proj.weight": rnd(H, INTER),
        f"{src}post_attention_layernorm.weight": 1 + rnd(H),
    }
    cfg = {"hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 10000.0}
    if algorithm == "eagle3":
        ids = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
        t |= {"fc.weight": rnd(H, 3 * H), f"{src}input_layernorm.weight": 1 + rnd(H),
              f"{src}hidden_norm.weight": 1 + rnd(H), "norm.weight": 1 + rnd(H),
              "lm_head.weight": rnd(DRAFT_VOCAB, H), "d2t": ids - torch.arange(DRAFT_VOCAB),
              "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)}
        cfg |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB}
        if aux is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    else:
        t["fc.weight"] = rnd(H, 2 * H)
        if fc_bias:
            t["fc.bias"] = rnd(H)
            cfg["bias"] = True
        cfg["architectures"] = ["LlamaForCausalLMEagle"]
    if drop:
        t.pop(drop)
    if bad_shape:
        t[bad_shape] = torch.zeros(3, 3)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_llama(tiny_target_dir, torch.float32)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_loads_published_keys(tmp_path, target, algorithm):
    head = load_eagle(write_checkpoint(tmp_path / algorithm, algorithm), target, torch.float32)
    assert head.cfg.algorithm == algorithm
    if algorithm == "eagle3":
        assert head.cfg.aux_layer_ids == (2, LAYERS // 2, LAYERS - 3)  # the default: inputs of 2, N/2, N-3
        assert head.logits(torch.randn(3, H)).shape == (3, DRAFT_VOCAB)
    else:
        assert head.logits(torch.randn(3, H)).shape == (3, VOCAB)  # the target's lm_head


def test_eagle3_aux_layers_from_config_and_d2t(tmp_path, target):
    path = write_checkpoint(tmp_path / "e3", "eagle3", aux=[1, 3, 6])
    head = load_eagle(path, target, torch.float32)
    assert head.cfg.aux_layer_ids == (1, 3, 6)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        hot = torch.nonzero(f.get_tensor("t2d")).flatten()
    assert torch.equal(head.to_target_ids(torch.arange(DRAFT_VOCAB)), hot)


def test_eagle_fc_bias(tmp_path, target):
    head = load_eagle(write_checkpoint(tmp_path / "b", "eagle", fc_bias=True), target, torch.float32)
    assert head.fc.bias is not None


@pytest.mark.parametrize(("algorithm", "key"), [("eagle", "layers.0.mlp.up_proj.weight"),
                                                ("eagle3", "midlayer.hidden_norm.weight"), ("eagle3", "d2t")])
def test_missing_key_is_named(tmp_path, target, algorithm, key):
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        load_eagle(write_checkpoint(tmp_path / algorithm, algorithm, drop=key), target, torch.float32)


def test_misshapen_key_is_named(tmp_path, target):
    with pytest.raises(ValueError, match=r"fc\.weight.*shape"):
        load_eagle(write_checkpoint(tmp_path / "e", "eagle", bad_shape="fc.weight"), target, torch.float32)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_save_load_round_trip(tmp_path, target, algorithm):
    head = load_eagle(write_checkpoint(tmp_path / "a", algorithm), target, torch.float32)
    again = load_eagle(save_eagle(head, tmp_path / "b", dtype=torch.float32), target, torch.float32)
    tokens, feats = torch.randint(0, VOCAB, (1, 5)), torch.randn(1, 5, head.cfg.feature_size)

    def dense(attn, x):
        q, k, v = attn.project(x, *(r[:5][None, :, None]
                                    for r in rope_table(head.cfg.layer_config(), 5, torch.float32)))
        o = torch.nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                             enable_gqa=True)
        return attn.o_proj(o.transpose(1, 2).reshape(1, 5, -1))

    assert torch.equal(head(tokens, feats, dense), again(tokens, feats, dense))


def test_fr_spec_token_map(tmp_path, target):
    head = load_eagle(write_checkpoint(tmp_path / "e", "eagle"), target, torch.float32)
    hot = torch.tensor([5, 17, 400, 9000])
    head.set_hot_ids(hot)
    h = torch.randn(2, H)
    assert torch.allclose(head.logits(h), (h @ target.lm_head.weight.T)[:, hot])
    assert head.to_target_ids(torch.tensor([0, 3])).tolist() == [5, 9000]
    with pytest.raises(ValueError, match="token_map"):
        head.set_hot_ids(torch.tensor([VOCAB]))


def _engine(tiny_target_dir, algorithm="none", batch=4, **spec):
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=batch, max_seq_len=256, spec=SpecConfig(algorithm=algorithm, **spec)))


def test_algorithm_must_match_checkpoint(tmp_path, tiny_target_dir):
    path = write_checkpoint(tmp_path / "e3", "eagle3")
    with pytest.raises(ValueError, match="drafter_path.*eagle3"):
        _engine(tiny_target_dir, "eagle", drafter_path=str(path))
    with pytest.raises(ValueError, match="drafter_path"):
        _engine(tiny_target_dir, "eagle3")


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (4, 3, 8)])
def test_greedy_lossless_with_continuous_batching(tmp_path, tiny_target_dir, algorithm, steps, topk, ndt):
    path = write_checkpoint(tmp_path / algorithm, algorithm)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = _engine(tiny_target_dir).generate(_prompts(), params)
    # batch 2 for 4 prompts: requests join and leave mid-run
    eng = _engine(tiny_target_dir, algorithm, batch=2, drafter_path=str(path), num_steps=steps, topk=topk,
                  num_draft_tokens=ndt)
    outs = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(o.num_draft_tokens > 0 for o in outs)
    # the pinned shape drafts every step: a catch-up forward (none where every request's head caught
    # up with its prefill just before), then one per later beam step
    prof = eng.profile
    assert prof.drafting_steps == prof.steps > 0
    assert prof.drafting_steps * (steps - 1) < prof.draft_forwards <= prof.drafting_steps * steps
    ms = prof.per_step_ms()
    # the time inside the head's forwards and output layer is part of the draft phase, not all of it
    assert 0 < ms["draft_model_per_forward"] < ms["draft_per_forward"]
    assert ms["device_wait"] == 0 and ms["host_work"] == ms["total"]  # on a CPU every step is host work


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_int8_draft_logits_stay_lossless(tmp_path, tiny_target_dir, monkeypatch, algorithm):
    """The draft logits through int8 weights (as on a CPU where that is timed faster, the head's
    checkpoint weights kept): the drafts change at most, the outputs do not."""
    from specserve.models import eagle_head as eagle_model
    from specserve.models.cpu_linear import Int8Linear

    monkeypatch.setattr(eagle_model, "fastest_logits_layer", Int8Linear)
    path = write_checkpoint(tmp_path / algorithm, algorithm)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eng = _engine(tiny_target_dir, algorithm, batch=2, drafter_path=str(path), num_steps=3, topk=2, num_draft_tokens=6,
                  draft_model_quantization="unquant")
    head = eng.drafter.head
    assert isinstance(head.lm_head if algorithm == "eagle3" else head.target_head.packed, Int8Linear)
    outs = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in _engine(tiny_target_dir).generate(_prompts(), params)]
    assert all(o.num_draft_tokens > 0 for o in outs)


@pytest.mark.skipif(not gguf_gemm.supported(), reason="the GGUF kernel needs x86-64 with AVX2, FMA and F16C")
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_q8_0_head_drafts_and_stays_lossless(tmp_path, tiny_target_dir, algorithm):
    """On a float32 CPU head, auto quantizes every bias-free linear to Q8_0 blocks (unquant keeps the
    checkpoint's): it drafts, and the outputs equal plain decoding's."""
    path = write_checkpoint(tmp_path / algorithm, algorithm)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    shape = {"drafter_path": str(path), "num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    quantized = _engine(tiny_target_dir, algorithm, batch=2, **shape)
    plain = _engine(tiny_target_dir, algorithm, batch=2, draft_model_quantization="unquant", **shape)
    assert quantized.drafter.quantization == "q8_0" and plain.drafter.quantization == "unquant"
    linears = [m for m in quantized.drafter.head.modules() if isinstance(m, (torch.nn.Linear, gguf_gemm.GGUFLinear))]
    assert linears and all(isinstance(m, gguf_gemm.GGUFLinear) for m in linears)
    assert not any(isinstance(m, gguf_gemm.GGUFLinear) for m in plain.drafter.head.modules())
    ref = _engine(tiny_target_dir).generate(_prompts(), params)
    outs, plain_outs = quantized.generate(_prompts(), params), plain.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outs] == [r.token_ids for r in ref]
    assert all(o.num_draft_tokens > 0 for o in outs)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_draft_cache_matches_recompute_and_training_unroll(tmp_path, tiny_target_dir, target, algorithm):
    """After prefill and several verify steps, (1) the drafter's last hidden state equals a dense
    recompute over the whole sequence with fresh target features, and (2) a chain draft (topk=1)
    equals the training-time-test unroll of `train_drafter` at the last position."""
    steps = 4
    eng = _engine(tiny_target_dir, algorithm, batch=1,
                  drafter_path=str(write_checkpoint(tmp_path / algorithm, algorithm)), num_steps=steps, topk=1)
    rid = eng.add_request(_prompts()[3], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    req = next(r for r in eng.running if r.request_id == rid)
    drafter = eng.drafter
    chain = drafter.propose([req]).tokens[0].tolist()  # [root, d1, ..., d_steps]

    seq = req.token_ids[: req.cache_len]  # target positions 0..L-1 (their K/V and features exist)
    ext = torch.tensor([seq + chain[:-1]])  # + root, d1 .. d_{steps-1}: the unroll's ground-truth inputs
    cache = KVCache(target.cfg, 1, ext.shape[1], torch.float32, "cpu")
    target.init_rope(ext.shape[1])
    hidden, aux = target_features(target, cache, ext, drafter.head.cfg.aux_layer_ids)
    feats = aux if algorithm == "eagle3" else hidden
    t = ext.shape[1]
    rope = rope_table(drafter.head.cfg.layer_config(), t + steps, torch.float32)
    unroll = ttt_losses(drafter.head, ext, feats, torch.zeros(1, t, 1), torch.zeros(1, t, dtype=torch.bool), steps,
                        rope)
    j = len(seq) - 1  # position L-1 pairs the root with the last accepted feature
    assert torch.allclose(unroll[0][0][0, j], drafter.last_hidden[req.slot], atol=1e-4)
    for i, (h, _, _, _) in enumerate(unroll):
        token = drafter.head.to_target_ids(drafter.head.logits(h[0, j]).argmax())
        assert int(token) == chain[i + 1], f"draft step {i}"
