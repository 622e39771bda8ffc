"""Structured outputs on xgrammar: compiled grammars, and each request's matcher over draft trees.

`GrammarCompiler` turns a `GrammarSpec` into xgrammar's compiled grammar for the served tokenizer,
in a worker thread of its own bounded by a timeout and a size (so a client cannot stall the
engine), and caches the results (xgrammar's own cache, bounded in bytes). `GrammarMatch` is one
request's position in its grammar: it masks the logits of every node of a draft tree (each node as
if the path to it had been emitted, `traverse_draft_tree`), names the tokens the grammar forces
next (`with_forced_paths` drafts them), spelled as the model spelled the same text before in a
request of its cache salt, and advances over the tokens the request emits. Nothing
here runs a model or decides acceptance: the verifier masks with it, the engine advances it.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from specserve.engine.sampling import masked_greedy_token
from specserve.grammar import GrammarSpec
from specserve.tree import DraftTree, TreeBatch

if TYPE_CHECKING:
    import xgrammar as xgr

Spellings = OrderedDict  # forced text (bytes) -> the tokens the model spelled it with last, most recent last

COMPILE_THREADS = 2  # a slow grammar holds one; the next request's compiles on the other
# a step whose every row's grammar forces at least this many tokens drafts only those (the drafter's
# tree would spend its nodes where the grammar already knows the answer)
FORCED_TOKENS_FOR_NO_DRAFT = 2
# on a CPU, the share of the compiled step program's rows a step's forced text may fill: every row
# costs there (2-core Zen 4, GGUF integer kernel: 8 requests with one forced token each, 16 rows, ran
# 0.96x plain decoding under the schemas of bench/structured.jsonl; one request with up to 15, 1.39x)
FORCED_ROWS_SHARE = 0.5
# forced texts whose spelling the engine remembers per cache salt (`GrammarMatch.forced`), the salts it
# remembers them for, and the forced texts a request follows at once
SPELLINGS_PER_SALT = 1024
SPELLING_SALTS = 64
PENDING_SPELLINGS = 8


class GrammarCompiler:
    """Compiles `GrammarSpec`s for the tokenizer of the model in `model_dir` (its `vocab_size`,
    `stop_ids` its EOS tokens). `max_bytes` bounds a constraint's text, `timeout_s` a compile."""

    def __init__(self, model_dir: str, vocab_size: int, stop_ids: Sequence[int], max_bytes: int,
                 timeout_s: float, cache_bytes: int = 64 << 20) -> None:
        self.tokenizer_file, self.vocab_size, self.stop_ids = f"{model_dir}/tokenizer.json", vocab_size, list(stop_ids)
        self.max_bytes, self.timeout_s, self.cache_bytes = max_bytes, timeout_s, cache_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._decoded_vocab: list[bytes] = []
        self._spellings: OrderedDict[str | None, Spellings] = OrderedDict()  # per cache salt, most recent last
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler for this tokenizer, built on first use (~0.1 s for a 49k vocabulary)."""
        with self._lock:
            if self._compiler is None:  # xgrammar loads here: an engine without structured outputs needs none
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(tokenizer_file=self.tokenizer_file)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._decoded_vocab = info.decoded_vocab  # each token's bytes
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self.cache_bytes)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError (starting with `structured_output`) when it is too large,
        does not compile, or takes longer than `timeout_s`."""
        size = len(spec.value.encode("utf-8"))
        if size > self.max_bytes:
            raise ValueError(f"structured_output: the {spec.kind} is {size} bytes, more than "
                             f"structured_output_max_bytes ({self.max_bytes})")
        compiler = self.compiler()
        future = self._pool.submit(_compile, compiler, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"structured_output: the {spec.kind} did not compile within "
                             f"{self.timeout_s:g} s (structured_output_compile_timeout_s)") from None
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors on a bad schema, regex or grammar
            raise ValueError(f"structured_output: the {spec.kind} does not compile: {compile_error(e)}") from None

    def match(self, spec: GrammarSpec, cache_salt: str | None = None) -> GrammarMatch:
        """A fresh matcher at the start of `spec`'s grammar, sharing the spellings of forced text that
        the requests of its `cache_salt` taught (requests of other salts never see them)."""
        compiled = self.compile(spec)
        with self._lock:
            spellings = self._spellings.pop(cache_salt, None)
            self._spellings[cache_salt] = spellings = spellings if spellings is not None else OrderedDict()
            if len(self._spellings) > SPELLING_SALTS:
                self._spellings.popitem(last=False)
        return GrammarMatch(compiled, self.vocab_size, self._decoded_vocab, spellings)


def _compile(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.value, any_whitespace=spec.any_whitespace)
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        return compiler.compile_grammar(choice_ebnf(spec.choices))
    return compiler.compile_grammar(spec.value)


def compile_error(e: Exception) -> str:
    """xgrammar's message for a client: its first line, without the time and source-file prefix."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(e).__name__
    return text[:300]


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarMatch:
    """One request's position in its grammar (xgrammar's `GrammarMatcher`), advanced by the tokens
    it emits; the root of a draft tree is the last token it accepted."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, decoded_vocab: Sequence[bytes] = (),
                 spellings: Spellings | None = None) -> None:
        """decoded_vocab: each token's bytes (xgrammar's `TokenizerInfo.decoded_vocab`), to learn how the
        model spells the texts the grammar forces (none learned without it) into `spellings` (shared by
        the requests of one cache salt; this request's own when None)."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._vocab = decoded_vocab
        self._spellings: Spellings = spellings if spellings is not None else OrderedDict()
        # forced texts offered as drafts, with the tokens emitted since and their bytes
        self._pending: list[tuple[bytes, list[int], bytes]] = []

    @property
    def terminated(self) -> bool:
        """The grammar ended and accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance over an emitted token; False (state unchanged) when the grammar forbids it."""
        if not self.matcher.accept_token(token):
            return False
        if self._pending:
            self._learn(token)
        return True

    def _learn(self, token: int) -> None:
        """An emitted token extends each forced text's pending spelling: a spelling that covers its
        text (or runs past it: `},` for `}`) is remembered, one that strays from it is dropped."""
        piece = self._vocab[token] if 0 <= token < len(self._vocab) else b""
        pending = []
        for text, tokens, spelled in self._pending:
            tokens, spelled = [*tokens, token], spelled + piece
            if spelled.startswith(text):
                self._spellings[text] = tokens
                self._spellings.move_to_end(text)
                if len(self._spellings) > SPELLINGS_PER_SALT:
                    self._spellings.popitem(last=False)
            elif text.startswith(spelled):
                pending.append((text, tokens, spelled))
        self._pending = pending

    def bitmask(self, tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
        """(N, ceil(vocab / 32)) int32 on the host, bit t of row i set when the grammar allows token t
        after node i of one draft tree (node 0 the root), each node as if its path had been emitted
        (`sampling.forbidden_tokens` reads it). A node the grammar rejects, and every node below it,
        allows nothing here: verification never accepts it (its parent's mask forbids its token), so
        its logits are never read. tokens, first_child, next_sibling: (N,) int64 on the host."""
        bitmask = torch.zeros(tokens.shape[0], (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.matcher.traverse_draft_tree(first_child, next_sibling, tokens, bitmask)
        return bitmask

    def allowed_nodes(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """The nodes of one draft tree (node 0 the root, the last token accepted; parents before
        children) whose path the grammar allows, in order: those worth verifying. The matcher is
        left as it was."""
        children: list[list[int]] = [[] for _ in tokens]
        for node in range(1, len(tokens)):
            children[parents[node]].append(node)
        allowed = [0]

        def visit(node: int) -> None:
            for child in children[node]:
                if self.matcher.accept_token(tokens[child]):
                    allowed.append(child)
                    if not self.matcher.is_terminated():  # after a stop token nothing is allowed
                        visit(child)
                    self.matcher.rollback(1)

        visit(0)
        return sorted(allowed)

    def greedy_targets(self, tokens: Sequence[int], first_child: Sequence[int], next_sibling: Sequence[int],
                       logits: torch.Tensor, targets: torch.Tensor) -> int:
        """Greedy verification's masked argmax along the path it will accept, masking only where
        needed: the unmasked argmax (`targets[node]`) stands wherever the grammar allows it (the
        mask removes tokens, so an allowed maximum is the masked one too); elsewhere the node's
        mask is filled and the largest allowed logit taken (`masked_greedy_token`). Walks from the root
        through the child whose token is the node's target, as `verify_greedy` will; nodes off that
        path keep unmasked targets, which nothing reads. logits (N, V), targets (N,) on the host;
        returns the number of masks filled. The matcher is left as it was."""
        node, walked, filled = 0, 0, 0
        while True:
            target = int(targets[node])
            if not self.matcher.accept_token(target):
                target = masked_greedy_token(logits[node], self._next_bitmask())
                filled += 1
                targets[node] = target
                if not self.matcher.accept_token(target):  # the grammar allows nothing here: never expected
                    break
            walked += 1
            if self.matcher.is_terminated():  # a stop token ended the grammar: nothing below is emitted
                break
            child = first_child[node]
            while child >= 0 and tokens[child] != target:
                child = next_sibling[child]
            if child < 0:
                break
            node = child
        self.matcher.rollback(walked)
        return filled

    def _next_bitmask(self) -> torch.Tensor:
        """(ceil(vocab / 32),) int32 on the host: bit t set when the grammar allows token t next."""
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(bitmask)
        return bitmask[0]

    def forced(self, encode: Callable[[str], list[int]], limit: int) -> list[int]:
        """Up to `limit` tokens spelling the text the grammar forces from here (xgrammar's jump-forward
        string), as far as the grammar accepts them; the matcher is left as it was. Drafts that cost no
        drafter: verification still decides whether the target agrees. The spelling is the one the
        model emitted for the same text last (in a request of this cache salt), else `encode`'s: a
        model under a grammar often spells forced text its own way (`"`, `i`, `te`, `ms` for `"items`),
        and a key that objects and requests repeat is then drafted as the model writes it."""
        text = self.matcher.find_jump_forward_string()
        if not text or limit <= 0:
            return []
        key = text.encode("utf-8")
        spelling = self._spellings.get(key)
        forced: list[int] = []
        for token in (spelling if spelling is not None else encode(text))[:limit]:
            if not self.matcher.accept_token(token):
                break
            forced.append(token)
        if forced:
            self.matcher.rollback(len(forced))
            if self._vocab and all(key != pending for pending, _, _ in self._pending):
                self._pending = [*self._pending[-(PENDING_SPELLINGS - 1):], (key, [], b"")]
        return forced


def forced_tokens(matches: Sequence[GrammarMatch | None], tokenizer: Tokenizer, limit: int,
                  step_seconds: Sequence[float | None] = ()) -> list[list[int]]:
    """Per request's matcher, up to `limit` tokens its grammar forces next (`GrammarMatch.forced`),
    tokenized by the served `tokenizer`; none without a matcher. With `step_seconds`, only as many
    as pay for their rows (`paying_forced`)."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    forced = [m.forced(encode, limit) if m is not None and limit > 0 else [] for m in matches]
    return paying_forced(forced, step_seconds) if step_seconds else forced


def paying_forced(forced: Sequence[list[int]], step_seconds: Sequence[float | None]) -> list[list[int]]:
    """Each row's first L forced tokens, the L that gives the step the most tokens per second:
    sum over rows of 1 + min(forced, L), over step_seconds[L], a step's expected seconds at L + 1
    tokens a request. A batch's rows are verified as a rectangle, so a forced token one row has
    costs a row in every other: at batch 4 one token forced in one row would cost 60 % more
    forward for 25 % more tokens. Where a depth's seconds are unknown (not measured yet, or no
    timed paths: a GPU), every forced token is kept, and the step measures that depth."""
    longest = max((len(f) for f in forced), default=0)
    best, best_rate = longest, 0.0
    for depth in range(longest + 1):
        seconds = step_seconds[depth] if depth < len(step_seconds) else None
        if seconds is None:
            return list(forced)
        rate = sum(1 + min(len(f), depth) for f in forced) / seconds
        if rate > best_rate:
            best, best_rate = depth, rate
    return [f[:best] for f in forced]


def with_forced_paths(batch: TreeBatch, forced: Sequence[list[int]], rooms: Sequence[int]) -> TreeBatch:
    """The batch's trees (on the host) with each row's forced tokens as a path below its root, beside
    the drafter's tree (`DraftTree.with_path`), within `rooms` nodes a tree: drafts no drafter pays
    for, checked by verification like any other."""
    trees = batch.unbatch()
    for i, (tokens, room) in enumerate(zip(forced, rooms)):
        room -= trees[i].num_draft_tokens
        if tokens and room > 0:
            trees[i] = trees[i].with_path(tokens[:room])
    return TreeBatch.from_trees(trees)


def without_forbidden(batch: TreeBatch, matches: Sequence[GrammarMatch | None]
                      ) -> tuple[TreeBatch, list[list[int]] | None]:
    """The batch's trees (on the host) without the nodes their grammar forbids, nor those below
    them (`GrammarMatch.allowed_nodes`): verification would never accept them, so no forward
    computes them. Also, per row, the kept nodes' indices in the given tree (new node j was
    node kept[j]); a row without a matcher keeps its tree. (batch, None) when nothing is forbidden."""
    trees = batch.unbatch()
    kept: list[list[int]] = []
    pruned = False
    for i, (tree, match) in enumerate(zip(trees, matches)):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        nodes = match.allowed_nodes(tokens, parents) if match is not None else list(range(len(tokens)))
        if len(nodes) < len(tokens):
            pruned = True
            new = {old: j for j, old in enumerate(nodes)}
            trees[i] = DraftTree.from_parents([tokens[j] for j in nodes], [new.get(parents[j], -1) for j in nodes])
        kept.append(nodes)
    return (TreeBatch.from_trees(trees), kept) if pruned else (batch, None)


@dataclass(frozen=True)
class ShapedTrees:
    """A step's trees as its requests' grammars leave them (`shape_trees`): `batch`, where a tree
    changed on the host; per row, the drafter's nodes `kept` (None: nothing pruned) and its tree's
    size before the forced text (`drafted_sizes`; None: none added); `pruned` nodes in all."""

    batch: TreeBatch
    kept: list[list[int]] | None = None
    drafted_sizes: list[int] | None = None
    pruned: int = 0

    @property
    def changed(self) -> bool:
        return self.kept is not None or self.drafted_sizes is not None

    def drafters_own(self, accepted: Sequence[list[int]]) -> list[list[int]]:
        """Per row, the accepted nodes the drafter's own tree held, numbered as it numbered them
        (a nested tree's prefix counts them so): the forced text, added below them, is won whatever
        the shape, and pruned nodes are not counted."""
        if self.drafted_sizes is not None:
            accepted = [[node for node in nodes if node < size] for nodes, size in zip(accepted, self.drafted_sizes)]
        if self.kept is not None:
            accepted = [[own[node] for node in nodes] for nodes, own in zip(accepted, self.kept)]
        return list(accepted)


def shape_trees(batch: TreeBatch, matches: Sequence[GrammarMatch | None], forced: Sequence[list[int]] | None,
                rooms: Sequence[int]) -> ShapedTrees:
    """The drafted nodes a grammar forbids pruned (`without_forbidden`), then the forced text added
    within `rooms` nodes a tree (`with_forced_paths`)."""
    kept, pruned, drafted_sizes = None, 0, None
    if not batch.is_root_only and any(m is not None for m in matches):
        drafted = int(batch.num_draft_tokens.sum())
        batch, kept = without_forbidden(batch, matches)
        pruned = drafted - sum(map(len, kept)) if kept is not None else 0
    if forced is not None and any(forced):
        drafted_sizes = batch.num_draft_tokens.tolist()
        batch = with_forced_paths(batch, forced, rooms)
    return ShapedTrees(batch, kept, drafted_sizes, pruned)
