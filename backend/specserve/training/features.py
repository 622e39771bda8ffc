"""`specserve dump-features`: run the frozen target once over a training set and store what every
drafter head trains on, so `train-drafter --features DIR` trains for many epochs without re-running
the target (the target's forward is most of the cost of online training).

A dump directory holds `index.json` (what was dumped: model, data, length cap, seed, dtype, the
EAGLE-3 auxiliary layers, the shard list) and shards `shard-NNNNN.safetensors`, each with

    tokens     (N,)      int32   the chat-template ids of its conversations, concatenated
    loss_mask  (N,)      uint8   1 where the token belongs to an assistant answer
    offsets    (S+1,)    int64   conversation s is rows offsets[s]:offsets[s+1]
    hidden     (N, H)    dtype   the target's final-norm hidden state (EAGLE-2 and MTP read it)
    aux        (N, 3H)   dtype   EAGLE-3's auxiliary-layer inputs (only when dumped with aux)

The target's distribution is not stored: a trainer recomputes it from `hidden` through the target's
`lm_head` rows for its draft vocabulary. Shards are written whole (a temporary file renamed), and
conversations come in one seeded order, so a dump that was stopped goes on from its last complete
shard. This module does not train and does not generate answers (`regenerate-data` does).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.training.configs import CONTENT_FIELDS, DumpConfig
from specserve.training.data import Sample

log = logging.getLogger(__name__)
INDEX = "index.json"


def dump(dc: DumpConfig) -> Path:
    """Write (or complete) the dump `dc.out_dir`; returns it."""
    from specserve.models.weights import load_llama
    from specserve.prompts import hf_tokenizer
    from specserve.training.data import training_samples

    if dc.num_threads:
        torch.set_num_threads(dc.num_threads)
    out = Path(dc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX
    content = {k: v for k, v in asdict(dc).items() if k in CONTENT_FIELDS}
    if index_path.is_file():
        old = json.loads(index_path.read_text())
        if {k: old.get(k) for k in CONTENT_FIELDS} != content:
            raise ValueError(f"resume: {out} holds a dump of different content; remove it or match it")
    else:
        index_path.write_text(json.dumps(content | {"complete": False}, indent=1) + "\n")
    samples = training_samples(hf_tokenizer(dc.model_dir), dc.data, dc.num_conversations, dc.max_len, dc.seed)
    dtype = getattr(torch, dc.dtype)
    target = load_llama(dc.model_dir, dtype, dc.device).requires_grad_(False)
    target.init_rope(dc.max_len)
    aux_layers = target.cfg.default_aux_layers() if dc.aux else ()
    cache = KVCache(target.cfg, dc.batch_size, dc.max_len, dtype, dc.device)
    shards = [samples[i : i + dc.shard_size] for i in range(0, len(samples), dc.shard_size)]
    names = [f"shard-{k:05d}.safetensors" for k in range(len(shards))]
    start, tokens_done = time.time(), 0
    bar = tqdm(total=sum(len(ids) for ids, _ in samples), desc="dump-features", unit="tok")
    for name, shard in zip(names, shards):
        n = sum(len(ids) for ids, _ in shard)
        if (out / name).is_file():
            bar.update(n)
            continue
        hidden, aux = [None] * len(shard), [None] * len(shard)
        order = sorted(range(len(shard)), key=lambda i: len(shard[i][0]))  # similar lengths share a batch
        for b in range(0, len(order), dc.batch_size):
            rows = order[b : b + dc.batch_size]
            t = max(len(shard[i][0]) for i in rows)
            tokens = torch.zeros(len(rows), t, dtype=torch.int64)
            for r, i in enumerate(rows):
                tokens[r, : len(shard[i][0])] = torch.tensor(shard[i][0])
            h, a = target_features(target, cache, tokens.to(dc.device), aux_layers)
            for r, i in enumerate(rows):
                length = len(shard[i][0])
                hidden[i] = h[r, :length].cpu()
                aux[i] = a[r, :length].cpu() if a is not None else None
            bar.update(sum(len(shard[i][0]) for i in rows))
        lengths = torch.tensor([len(ids) for ids, _ in shard])
        tensors = {
            "tokens": torch.tensor([t for ids, _ in shard for t in ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for _, mask in shard for m in mask], dtype=torch.uint8),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "hidden": torch.cat(hidden).contiguous(),
        }
        if dc.aux:
            tensors["aux"] = torch.cat(aux).contiguous()
        tmp = out / (name + ".tmp")
        save_file(tensors, str(tmp))
        tmp.rename(out / name)
        tokens_done += n
        if dc.max_minutes and time.time() - start > dc.max_minutes * 60 and name != names[-1]:
            log.warning("dump-features: max_minutes reached after %s; run it again to go on", name)
            bar.close()
            return out
    bar.close()
    record = content | {"complete": True, "shards": names, "conversations": len(samples),
                        "tokens": sum(len(ids) for ids, _ in samples), "hidden_size": target.cfg.hidden_size,
                        "aux_layer_ids": list(aux_layers), "device": dc.device,
                        "minutes_this_run": round((time.time() - start) / 60, 2), "tokens_this_run": tokens_done}
    index_path.write_text(json.dumps(record, indent=1) + "\n")
    return out


@torch.no_grad()
def target_features(target: LlamaModel, cache: KVCache, tokens: torch.Tensor, aux_layers: tuple[int, ...]):  # noqa: ANN201
    """tokens (B, T) -> (final-norm hidden (B, T, H), aux inputs (B, T, 3H) or None)."""
    b, t = tokens.shape
    dev = tokens.device
    slots = list(range(b))
    attn = target.attention_inputs(torch.arange(t, device=dev).expand(b, t), torch.tensor(slots, device=dev),
                                   torch.zeros(b, dtype=torch.int64, device=dev), None, cache, [0] * b, slots)
    out = target(tokens, attn, cache, logit_index=torch.zeros(b, 1, dtype=torch.int64, device=dev),
                 aux_layers=aux_layers)
    return out.hidden, out.aux_hidden


class FeatureStore:
    """A dump opened for training: every conversation's ids and answer mask in memory, its features
    read from the memory-mapped shards per batch. Does not hold features in memory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX
        if not index_path.is_file():
            raise FileNotFoundError(f"features: no {INDEX} in {self.path} (run `specserve dump-features` first)")
        self.index = json.loads(index_path.read_text())
        if not self.index.get("complete", True):
            raise ValueError(f"features: the dump in {self.path} is not complete; run dump-features again to finish it")
        self.samples: list[Sample] = []
        self._where: list[tuple[int, int, int]] = []  # per conversation: (shard, first row, end row)
        self._files = []
        for k, name in enumerate(self.index["shards"]):
            f = safe_open(str(self.path / name), framework="pt")
            self._files.append(f)
            tokens, mask, offsets = (f.get_tensor(n).tolist() for n in ("tokens", "loss_mask", "offsets"))
            for s, e in zip(offsets[:-1], offsets[1:]):
                self.samples.append((tokens[s:e], [bool(m) for m in mask[s:e]]))
                self._where.append((k, s, e))

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.index["aux_layer_ids"])

    def features(self, ids: list[int], length: int, aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Conversations `ids` padded to `length` rows with zeros -> (hidden (B, T, H), aux (B, T, 3H)
        or None)."""
        names = ("hidden", "aux") if aux else ("hidden",)
        if aux and not self.aux_layer_ids:
            raise ValueError(f"features: {self.path} was dumped without EAGLE-3's auxiliary inputs (--aux)")
        out = []
        for name in names:
            rows = []
            for i in ids:
                k, s, e = self._where[i]
                x = self._files[k].get_slice(name)[s:e]
                rows.append(torch.nn.functional.pad(x, (0, 0, 0, length - (e - s))))
            out.append(torch.stack(rows))
        return out[0], (out[1] if aux else None)
