"""Draft heads by method: the one place that says which module builds, loads and saves the head
of `eagle`, `eagle3` and `mtp` (the methods whose `Method.is_head`).

Serving (`drafters.head`) loads heads through `HEADS[method].load`; training
(`training.train_drafter`, `training.train_heads`) builds, reloads and saves them through the same
table. Each head's network and published format live in `eagle_head` / `mtp_head`; this module
only chooses between them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.methods import method
from specserve.models.eagle_head import (
    Eagle2Head,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    load_eagle,
    save_eagle,
)
from specserve.models.llama import LlamaModel
from specserve.models.mtp_head import MtpConfig, MtpHead, load_mtp, save_mtp

DraftHead = EagleHead | MtpHead
TOKEN_MAP = "token_map.pt"  # a head's draft vocabulary, next to its weights (SGLang's --speculative-token-map)


def load_token_map(path: str | Path) -> torch.Tensor:
    """FR-Spec hot token ids: a torch-saved 1-D tensor or list (SGLang's --speculative-token-map)."""
    ids = torch.load(path, map_location="cpu", weights_only=True)
    return torch.as_tensor(ids, dtype=torch.int64)


class HeadFormat:
    """How one method's head is made, read and written."""

    name: str

    def new(self, target: LlamaModel, draft_ids: torch.Tensor) -> DraftHead:
        """A freshly initialised head with the target's shapes over the draft vocabulary `draft_ids`."""
        raise NotImplementedError

    def read(self, path: Path, target: LlamaModel, dtype: torch.dtype, device: str) -> DraftHead:
        raise NotImplementedError

    def write(self, head: DraftHead, out_dir: Path) -> Path:
        raise NotImplementedError

    def load(self, path: str | Path, target: LlamaModel, dtype: torch.dtype, device: str = "cpu",
             field: str = "drafter_path") -> DraftHead:
        """A published head from a local directory; a ValueError naming `field` when it holds
        another method's."""
        head = self.read(Path(path), target, dtype, device)
        if head.cfg.algorithm != self.name:
            raise ValueError(f"{field}: {path} holds an {head.cfg.algorithm} drafter, not {self.name} "
                             f"(set algorithm={head.cfg.algorithm})")
        return head

    def save(self, head: DraftHead, out_dir: str | Path, draft_ids: torch.Tensor) -> Path:
        """The head in its published format, with its token map when the method ships one."""
        out_dir = self.write(head, Path(out_dir))
        if method(self.name).token_map:
            torch.save(draft_ids.cpu(), out_dir / TOKEN_MAP)
        return out_dir

    def draft_ids(self, head: DraftHead, path: str | Path) -> torch.Tensor:
        """The draft vocabulary a saved head was trained over (its token map), set on the head."""
        token_map = Path(path) / TOKEN_MAP
        if not token_map.is_file():
            raise FileNotFoundError(f"init_from: no {TOKEN_MAP} in {path}")
        ids = load_token_map(token_map)
        head.set_hot_ids(ids)
        return ids


class EagleFormat(HeadFormat):
    def __init__(self, head_class: type[EagleHead]) -> None:
        self.head_class, self.name = head_class, head_class.algorithm

    def new(self, target: LlamaModel, draft_ids: torch.Tensor) -> EagleHead:
        """EAGLE-1/2 read the target's lm_head restricted to the draft vocabulary (FR-Spec), in
        training as in serving; see `Eagle3Format` for EAGLE-3."""
        head = self.head_class(self.config(target, draft_ids), target)
        head.set_hot_ids(draft_ids)
        return head

    def config(self, target: LlamaModel, draft_ids: torch.Tensor, **own: object) -> EagleConfig:
        """The target's shapes (`own`: what this method sets otherwise)."""
        tc = target.cfg
        return EagleConfig(**{
            "algorithm": self.name, "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
            "num_heads": tc.num_heads, "num_kv_heads": tc.num_kv_heads, "head_dim": tc.head_dim,
            "rms_norm_eps": tc.rms_norm_eps, "rope_theta": tc.rope_theta, "vocab_size": tc.vocab_size,
            "draft_vocab_size": tc.vocab_size, "target_hidden_size": tc.hidden_size, **own,
        })

    def read(self, path: Path, target: LlamaModel, dtype: torch.dtype, device: str) -> EagleHead:
        return load_eagle(path, target, dtype, device)

    def write(self, head: EagleHead, out_dir: Path) -> Path:
        return save_eagle(head, out_dir)


class Eagle3Format(EagleFormat):
    def new(self, target: LlamaModel, draft_ids: torch.Tensor) -> EagleHead:
        """Its lm_head and norm start from the target's rows for the draft vocabulary (d2t maps
        them back)."""
        head = self.head_class(self.config(target, draft_ids), target)
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
            head.norm.weight.copy_(target.norm.weight)
            head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        return head

    def config(self, target: LlamaModel, draft_ids: torch.Tensor, **own: object) -> EagleConfig:
        return super().config(target, draft_ids, draft_vocab_size=len(draft_ids),
                              aux_layer_ids=target.cfg.default_aux_layers(), **own)

    def draft_ids(self, head: DraftHead, path: str | Path) -> torch.Tensor:
        """EAGLE-3 carries its vocabulary as d2t."""
        return torch.arange(head.cfg.draft_vocab_size) + head.d2t


class MtpFormat(HeadFormat):
    name = "mtp"

    def new(self, target: LlamaModel, draft_ids: torch.Tensor) -> MtpHead:
        """A DeepSeek-layout head after the target's last layer, its final norm the target's."""
        tc = target.cfg
        head = MtpHead(MtpConfig(layout="deepseek", target=tc, prefix=f"model.layers.{tc.num_layers}."), target)
        with torch.no_grad():
            head.final_norm.weight.copy_(target.norm.weight)
        head.set_hot_ids(draft_ids)
        return head

    def read(self, path: Path, target: LlamaModel, dtype: torch.dtype, device: str) -> MtpHead:
        return load_mtp(path, target, dtype, device)

    def write(self, head: MtpHead, out_dir: Path) -> Path:
        return save_mtp(head, out_dir)


HEADS: dict[str, HeadFormat] = {f.name: f for f in (EagleFormat(Eagle2Head), Eagle3Format(Eagle3Head), MtpFormat())}
