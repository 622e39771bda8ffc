"""`specserve train-drafters`: the EAGLE-3, EAGLE-2 and MTP heads trained together against the
frozen target, from a corpus of its own answers (`regenerate-data`), inside one time limit.

Per batch the target runs once on the device and every head trains on that forward's features
(final-norm hidden states, EAGLE-3's auxiliary-layer inputs) and labels (the target's distribution
over the draft vocabulary): nothing is dumped or carried. Each method's recipe (`RECIPES`) is the
published trainers': EAGLE-3 unrolls 5 self-fed steps (training-time test), EAGLE-2 unrolls 3
with EAGLE's feature regression and uniform feature noise, MTP unrolls 3 (one head serves every
draft step); steps weigh 0.8^i. The draft vocabulary is the most frequent tokens of the corpus's
answers (EAGLE-3's d2t; EAGLE-2's and MTP's FR-Spec token map).

The time limit covers the whole command: loading, training (by the clock: warm-up, then cosine
decay over the time left), the held-out evaluation (teacher-forced top-1 agreement per unrolled
step on the corpus's last `holdout` rows, for the new heads and for the drafters served today) and
writing. Each head is written in its published format with a model card (`<out>/<algorithm>/`),
and, with `archive_dir`, as one tar per head cut into parts of at most `archive_part_mib`
(`cat eagle3.tar.* | tar -x`), beside `train-drafters.json`. With `generate_answer_tokens` the
command first grows the corpus on the device with the target's own answers (`regenerate`, at most
`generate_share` of its minutes) and returns the grown corpus as tar parts too when they fit. It
does not replace the served drafters (a person compares and commits them).
"""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from specserve.methods import method
from specserve.models.draft_heads import HEADS, DraftHead
from specserve.models.kv_cache import KVCache
from specserve.models.llama import rope_table
from specserve.models.weights import load_llama
from specserve.training.configs import RECIPES, HeadsConfig
from specserve.training.corpus import Corpus
from specserve.training.features import target_features
from specserve.training.steps import batches, draft_vocabulary, learning_rate, padded
from specserve.training.train_drafter import (
    expected_accepted,
    head_objective,
    label_probs,
    saved_head,
)

log = logging.getLogger(__name__)


Sample = tuple[np.ndarray, int]  # (ids (T,), prompt length): the answer is ids[prompt length:]
WARMUP_SHARE = 0.1  # the warm-up ends within this share of the training time (a slow machine makes few steps)


class Batcher:
    """The target's features for a batch of rows, computed on the device, and its labels over a
    draft vocabulary."""

    def __init__(self, target, samples: list[Sample], hc: HeadsConfig) -> None:  # noqa: ANN001
        self.target, self.samples, self.hc = target, samples, hc
        self.aux_layers = target.cfg.default_aux_layers()
        self.cache = KVCache(target.cfg, hc.max_rows, hc.max_len, target.lm_head.weight.dtype, hc.device)
        target.init_rope(hc.max_len)

    def label_head(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """(V', H): the target's lm_head rows of a draft vocabulary."""
        return self.target.lm_head.weight[draft_ids.to(self.hc.device)]

    def __call__(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """tokens, mask (B, T); hidden (B, T, H); aux_hidden (B, T, 3H)."""
        tokens, mask = padded(self.samples, rows, self.hc.device)
        hidden, aux = target_features(self.target, self.cache, tokens, self.aux_layers)
        return {"tokens": tokens, "mask": mask, "hidden": hidden, "aux_hidden": aux}


@torch.no_grad()
def agreement(heads: dict[str, tuple[DraftHead, torch.Tensor]], batcher: Batcher, held: list[list[int]],
              rope, bf16: bool) -> dict[str, list[float]]:  # noqa: ANN001
    """Teacher-forced top-1 agreement with the target per unrolled step, per head, on `held`.
    heads: algorithm -> (head, its label head `Batcher.label_head`)."""
    hits = {a: [0.0] * RECIPES[a].steps for a in heads}
    counts = {a: [0.0] * RECIPES[a].steps for a in heads}
    for rows in held:
        b = batcher(rows)
        probs = {}  # heads of one vocabulary share their labels
        for a, (head, label_head) in heads.items():
            if id(label_head) not in probs:
                probs[id(label_head)] = label_probs(b["hidden"], label_head)
            _, steps = head_objective(a, head, b["tokens"], b["mask"], b["hidden"], b["aux_hidden"],
                                      probs[id(label_head)], RECIPES[a].steps, rope, bf16)
            for k, (_, _, acc, n) in enumerate(steps):
                hits[a][k] += float(acc) * float(n)
                counts[a][k] += float(n)
    return {a: [round(h / c, 4) if c else 0.0 for h, c in zip(hits[a], counts[a])] for a in heads}


def open_corpus(path: str, work: Path) -> Corpus:
    """A corpus directory, or one unpacked from a .tar of it into `work`."""
    if path.endswith(".tar"):
        with tarfile.open(path) as tar:
            tar.extractall(work, filter="data")
        found = sorted(work.rglob("corpus.json"))
        if not found:
            raise FileNotFoundError(f"corpus: no corpus.json inside {path}")
        return Corpus(found[0].parent)
    return Corpus(path)


def grow_corpus(hc: HeadsConfig, corpus_dir: Path, start: float) -> dict:
    """The generation phase: the given corpus (if any) copied to `corpus_dir`, then the target's own
    answers appended on the device (`regenerate`, greedy, loops cut) until it holds
    `generate_answer_tokens` or `generate_share` of the command's minutes have gone; its record."""
    from specserve.training.regenerate import RegenerateConfig, regenerate

    if hc.corpus:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(open_corpus(hc.corpus, Path(tmp)).path, corpus_dir, dirs_exist_ok=True)
    given = Corpus(corpus_dir) if (corpus_dir / "corpus.json").is_file() else None
    before = given.answer_tokens if given else 0
    # answers appended as the given ones were made (an append must match the corpus's settings)
    same = {k: given.meta[k] for k in ("dtype", "max_prompt_tokens", "max_new_tokens", "temperature")} if given else {}
    minutes = hc.minutes * hc.generate_share - (time.time() - start) / 60
    began = time.time()
    if before < hc.generate_answer_tokens and minutes > 0:
        regenerate(RegenerateConfig(**{"dtype": hc.dtype, **same}, model_dir=hc.model_dir, out=str(corpus_dir),
                                    data=hc.prompts, batch_size=hc.generate_batch_size, max_minutes=minutes,
                                    device=hc.device, max_answer_tokens=hc.generate_answer_tokens, seed=hc.seed))
    seconds = time.time() - began
    made = Corpus(corpus_dir).answer_tokens - before
    return {"answer_tokens_given": before, "answer_tokens_made": made, "seconds": round(seconds, 1),
            "answer_tokens_per_s": round(made / seconds, 1) if made else 0.0}


def train_drafters(hc: HeadsConfig) -> dict:
    """Train the heads of `hc.algorithms` within `hc.minutes` (after growing the corpus on the
    device first, with `generate_answer_tokens`); returns the run's record."""
    start = time.time()
    deadline = start + hc.minutes * 60
    torch.manual_seed(hc.seed)
    out = Path(hc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype, dev, bf16 = getattr(torch, hc.dtype), hc.device, hc.dtype == "bfloat16"
    generation = grow_corpus(hc, out / "corpus", start) if hc.generate_answer_tokens else None
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(out / "corpus") if generation else open_corpus(hc.corpus, Path(tmp))
        samples = [s for s in corpus.samples(hc.max_len) if len(s[0]) - s[1] >= 2]
    if len(samples) <= hc.holdout:
        raise ValueError(f"corpus: {len(samples)} usable rows, holdout {hc.holdout}: nothing left to train on")
    train_rows, held_rows = samples[: -hc.holdout], samples[-hc.holdout :]
    target = load_llama(hc.model_dir, dtype, dev).requires_grad_(False)
    draft_ids = draft_vocabulary(train_rows, hc.draft_vocab_size, target.cfg.eos_token_ids,
                                 vocab_size=target.cfg.vocab_size)
    heads = {a: HEADS[a].new(target, draft_ids).to(dev).train() for a in hc.algorithms}
    batcher = Batcher(target, samples, hc)
    label_head = batcher.label_head(draft_ids)
    new = {a: (h, label_head) for a, h in heads.items()}
    max_steps = max(RECIPES[a].steps for a in heads)
    rope = tuple(r.to(dev) for r in rope_table(next(iter(heads.values())).cfg.layer_config(), hc.max_len + max_steps,
                                               dtype))
    n_train = len(train_rows)
    held = batches(held_rows, hc.max_rows, hc.seed, hc.batch_tokens)
    held = [[n_train + i for i in b] for b in held]
    served = served_agreement(hc, target, batcher, held, rope, bf16)
    t0 = time.time()
    initial = agreement(new, batcher, held, rope, bf16)  # fresh heads; and what one evaluation costs
    # the final evaluation, then writing and archives (seconds a head, at most a sixth of a short run)
    reserve = 2 * (time.time() - t0) + min(10 + 5 * len(heads), hc.minutes * 10)
    params = {a: [p for p in h.parameters() if p.requires_grad] for a, h in heads.items()}
    opts = {a: torch.optim.AdamW(params[a], lr=hc.lr, weight_decay=0.0) for a in heads}
    train_start, step, epoch, token_passes = time.time(), 0, 0, 0
    losses = {a: [] for a in heads}
    step_seconds = 0.0  # the longest step so far: one more must end before the reserve
    while time.time() + step_seconds < deadline - reserve:
        plan = batches(train_rows, hc.max_rows, hc.seed + epoch, hc.batch_tokens)
        for rows in plan:
            step_start = time.time()
            progress = (step_start - train_start) / max(deadline - reserve - train_start, 1e-9)
            if progress >= 1.0 or step_start + step_seconds >= deadline - reserve:
                break
            b = batcher(rows)
            probs = label_probs(b["hidden"], label_head)
            for a, head in heads.items():
                loss, _ = head_objective(a, head, b["tokens"], b["mask"], b["hidden"], b["aux_hidden"], probs,
                                         RECIPES[a].steps, rope, bf16, RECIPES[a].feature_noise)
                for group in opts[a].param_groups:
                    group["lr"] = learning_rate(hc.lr, step, progress, hc.warmup_steps, WARMUP_SHARE)
                opts[a].zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params[a], 0.5)
                opts[a].step()
                if step % 50 == 0:
                    losses[a].append(round(loss.item(), 4))
            token_passes += sum(len(samples[i][0]) for i in rows)
            step += 1
            step_seconds = max(step_seconds, time.time() - step_start)
            if step % 200 == 0:
                log.info("train-drafters: step %d, epoch %d, %.1f min", step, epoch, (time.time() - start) / 60)
        epoch += 1
    train_minutes = (time.time() - train_start) / 60
    for head in heads.values():
        head.eval()
    final = agreement(new, batcher, held, rope, bf16)
    record = {
        "config": asdict(hc), "device": device_name(dev), "corpus": {
            "rows": len(corpus.rows), "answer_tokens": corpus.answer_tokens, "meta": corpus.meta,
            "train_rows": n_train, "heldout_rows": hc.holdout},
        "generation": generation, "steps": step,
        "epochs": round(token_passes / sum(len(ids) for ids, _ in train_rows), 2),
        "token_passes": token_passes, "train_minutes": round(train_minutes, 2),
        "heads": {a: {"heldout_agreement": final[a], "initial_heldout_agreement": initial[a],
                      "served_heldout_agreement": served.get(a),
                      "expected_accepted": round(expected_accepted(final[a]), 4),
                      "served_expected_accepted": round(expected_accepted(served[a]), 4) if served.get(a) else None,
                      "loss_every_50_steps": losses[a]} for a in heads},
    }
    for a, head in heads.items():
        write_head(a, head, draft_ids, out / a, record)
    record["minutes"] = round((time.time() - start) / 60, 2)
    (out / "train-drafters.json").write_text(json.dumps(record, indent=1) + "\n")
    if hc.archive_dir:
        written = pack(out, list(heads), Path(hc.archive_dir), hc.archive_part_mib)
        record["corpus_archived"] = bool(generation) and corpus_fits(out / "corpus", len(written), hc.archive_part_mib)
        if record["corpus_archived"]:
            pack(out, ["corpus"], Path(hc.archive_dir), hc.archive_part_mib)
    record["minutes"] = round((time.time() - start) / 60, 2)
    (out / "train-drafters.json").write_text(json.dumps(record, indent=1) + "\n")
    if hc.archive_dir:
        (Path(hc.archive_dir) / "train-drafters.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def served_agreement(hc: HeadsConfig, target, batcher: Batcher, held: list[list[int]], rope,  # noqa: ANN001
                     bf16: bool) -> dict[str, list[float]]:
    """Held-out agreement of the drafters served today, each over its own draft vocabulary."""
    served = {}
    for a in hc.algorithms if hc.served_repository else ():
        path = Path(hc.served_repository, f"llm_{a}", "drafter")
        if not (path / "model.safetensors").is_file():
            continue
        try:
            head, ids = saved_head(a, path, target)
        except ValueError as e:  # a drafter of another target
            log.warning("train-drafters: the served %s drafter is not compared (%s)", a, e)
            continue
        served[a] = (head.to(device=hc.device).eval().requires_grad_(False), batcher.label_head(ids))
    return agreement(served, batcher, held, rope, bf16) if served else {}


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def write_head(algorithm: str, head: DraftHead, draft_ids: torch.Tensor, out: Path, record: dict) -> None:
    """The head in its published format, its token map (EAGLE-2, MTP) and a model card."""
    out.mkdir(parents=True, exist_ok=True)
    HEADS[algorithm].save(head, out, draft_ids)
    r, h, c = RECIPES[algorithm], record["heads"][algorithm], record["corpus"]
    served = h["served_heldout_agreement"]
    card = f"""# {r.name} drafter for {Path(record['config']['model_dir']).name}

Trained by `specserve train-drafters` with the EAGLE-3, EAGLE-2 and MTP heads of the same run.

| | |
|---|---|
| data | the target's own answers (`specserve regenerate-data`): {c['rows']:,} rows, {c['answer_tokens']:,} answer \
tokens ({c['meta']['dtype']} target, greedy); the last {c['heldout_rows']} rows held out |
| draft vocabulary | the {record['config']['draft_vocab_size']} most frequent answer tokens |
| recipe | {r.steps} unrolled steps weighted 0.8^i{', feature regression' if r.feature_regression else ''}\
{', uniform feature noise ' + str(r.feature_noise) if r.feature_noise else ''}; \
AdamW lr {record['config']['lr']}, cosine over the time |
| token-passes | {record['token_passes']:,} ({record['steps']} steps, {record['epochs']} epochs) |
| time, device | {record['train_minutes']} min of training on {record['device']} |
| held-out top-1 agreement by depth | {', '.join(f'{a:.3f}' for a in h['heldout_agreement'])} \
(expected accepted {h['expected_accepted']}) |
| the served drafter, same rows | {', '.join(f'{a:.3f}' for a in served) if served else 'not measured'} |

Load it with `--algorithm {algorithm} --drafter-path <this dir>\
{' --token-map <this dir>/token_map.pt' if method(algorithm).token_map else ''}`.
"""
    (out / "README.md").write_text(card)


MAX_ARCHIVE_FILES = 8  # what a GPU machine returns: the parts, train-drafters.json and train.log


def corpus_fits(corpus_dir: Path, parts_written: int, part_mib: int) -> bool:
    """Whether the corpus's tar parts fit beside `parts_written` head parts and the two records."""
    size = sum(f.stat().st_size for f in corpus_dir.rglob("*") if f.is_file()) + 10240  # tar headers and end
    return parts_written + -(-size // (part_mib * 1024 * 1024)) + 2 <= MAX_ARCHIVE_FILES


def pack(out: Path, algorithms: list[str], archive_dir: Path, part_mib: int) -> list[Path]:
    """One uncompressed tar per head directory, cut into parts of at most part_mib MiB:
    `<algorithm>.tar.00`, `.01`, ... (`cat <algorithm>.tar.* | tar -x` joins and unpacks)."""
    archive_dir.mkdir(parents=True, exist_ok=True)
    limit, written = part_mib * 1024 * 1024, []
    for a in algorithms:
        whole = archive_dir / f"{a}.tar"
        with tarfile.open(whole, "w") as tar:
            tar.add(out / a, arcname=a)
        data = whole.read_bytes()
        whole.unlink()
        for k in range(0, max(len(data), 1), limit):
            part = archive_dir / f"{a}.tar.{k // limit:02d}"
            part.write_bytes(data[k : k + limit])
            written.append(part)
    return written
