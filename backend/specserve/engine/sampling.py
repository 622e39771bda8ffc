"""Turn target logits into what verification consumes: argmax tokens (greedy) or probabilities.

The same processing applies at every tree node and in plain decoding, so speculative and plain
decoding see the same target distribution (the lossless guarantee rests on that).
This module draws no random numbers: verification gets uniforms from `draw_uniforms`.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.config import SamplingParams
from specserve.staging import to_device


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> (...,) int64: each row's first largest index, as `argmax(-1)` gives it (NaN the
    largest, as there). float32 on a CPU through numpy's vectorised argmax, in place on any strides: at a 49k
    vocabulary on a 2-core Zen 4 7 us a row against torch's 45 (26 against 256 for a 6-node tree); elsewhere
    through `max` over the last dimension (on a CPU a third of torch's argmax time)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1), dtype=np.int64))
    return logits.max(-1).indices


def masked_greedy_token(logits: torch.Tensor, bitmask: torch.Tensor) -> int:
    """The token `greedy_tokens` picks once every token a grammar forbids is at -inf: the first
    largest allowed index (the first allowed one where all allowed are -inf). logits (V,) float32 and
    bitmask (W,) int32 (bit t of word t // 32 set: token t allowed; tokens past it forbidden) on the
    host; 0 where nothing is allowed. In numpy on one thread, the logits left as they are; where few
    32-token words allow anything, only those are read (a grammar that allows a few hundred tokens
    costs microseconds)."""
    values = logits.float().numpy()
    v = values.shape[0]
    words = bitmask.numpy()[: -(-v // 32)]
    live = np.flatnonzero(words)
    if not len(live):
        return 0
    if 4 * len(live) > len(words):  # dense: one pass over the vocabulary
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little", count=v).view(bool)
        best = int(np.argmax(np.where(allowed, values, -np.inf)))
        return best if allowed[best] else int(np.argmax(allowed))
    index = live[:, None] * 32 + np.arange(32)  # (m, 32): the tokens of each live word, ascending
    allowed = np.unpackbits(words[live].view(np.uint8), bitorder="little").reshape(-1, 32).view(bool)
    allowed &= index < v
    if not allowed.any():  # only bits past the vocabulary
        return 0
    candidates = np.where(allowed, values.take(np.minimum(index, v - 1)), -np.inf)
    best = int(np.argmax(candidates))  # row-major: the first of equal maxima has the lowest token index
    if not allowed.flat[best]:  # every allowed token at -inf: the first allowed one
        best = int(np.argmax(allowed))
    return int(index.flat[best])


def suppress_eos(logits: torch.Tensor, depth: torch.Tensor, eos_ids: tuple[int, ...], tokens_short: int,
                 forbidden: torch.Tensor | None = None) -> None:
    """In place: forbid EOS at nodes that would emit an output token before `min_tokens` is reached,
    except, under a grammar (`forbidden` (N, V) bool: the tokens it forbids per node), where it
    allows nothing else: a grammar's end comes before min_tokens.

    logits: (N, V); depth: (N,) node depths (node at depth d emits output token number produced + d).
    tokens_short: min_tokens - produced.
    """
    if tokens_short <= 0 or not eos_ids:
        return
    rows = depth < tokens_short  # (N,)
    eos = to_device(list(eos_ids), logits.device)
    if forbidden is not None:
        allowed = ~forbidden
        rows &= allowed.sum(-1) > allowed[:, eos].sum(-1)  # some token besides EOS is allowed
    logits[:, eos] = logits[:, eos].masked_fill(rows[:, None], float("-inf"))  # no host read of `rows`


def apply_penalties(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
                    tree_tokens: torch.Tensor, sees: torch.Tensor) -> None:
    """In place: the repetition, frequency and presence penalties at every node of one request's tree.

    Node i's context is the request's tokens so far (the root last) followed by the drafts on its
    path, so each node is penalised exactly as plain decoding would be at that point.
    logits: (N, V) float32; token_ids: prompt + output so far, the root last; tree_tokens: (N,),
    node 0 the root; sees: (N, N) bool, sees[i, j] when node j is on node i's path (itself included).
    """
    if not params.has_penalties:
        return
    n, vocab = logits.shape
    ids = to_device(token_ids, logits.device)
    # (N, V): output-token counts per node: the output so far plus the drafts on the node's path
    output = ids[num_prompt_tokens:]  # scatter_add, not bincount: its size would need a host read
    counts = logits.new_zeros(vocab).scatter_add_(0, output, logits.new_ones(output.shape)).expand(n, vocab).clone()
    counts.scatter_add_(1, tree_tokens[None, 1:].expand(n, -1), sees[:, 1:].to(logits.dtype))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen.index_fill_(1, ids, True)  # the prompt counts for the repetition penalty
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N, V) logits -> (N, V) float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[dict[int, tuple[float, int]]]:
    """Per emitted token, {token id: (log-probability, rank)} for it and the top_n alternatives.

    logits: (K, V), row k the (penalised, EOS-suppressed, temperature-free) logits the k-th token
    was drawn from; rank 1 is the most likely token.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (K, V)
    chosen = to_device(tokens, logits.device)
    chosen_logp = logp.gather(1, chosen[:, None])  # (K, 1)
    ranks = (logp > chosen_logp).sum(-1) + 1  # (K,)
    top_logp, top_ids = logp.topk(top_n, dim=-1) if top_n else (logp[:, :0], chosen[:, None][:, :0])
    out = []
    for k, token in enumerate(tokens):
        entry = {int(t): (float(lp), i + 1) for i, (t, lp) in enumerate(zip(top_ids[k].tolist(), top_logp[k].tolist()))}
        entry[token] = (float(chosen_logp[k, 0]), int(ranks[k]))
        out.append(entry)
    return out


def draw_uniforms(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """(n,) float32 uniforms in [0, 1) from a request's own generator (seeded requests repeat)."""
    return torch.rand(n, generator=generator, dtype=torch.float32)


_FORBIDDEN_BITS: dict[torch.device, torch.Tensor] = {}


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, W) int32 grammar masks, bit t of row i set = token t allowed at node i -> (N, vocab_size)
    bool, True where forbidden, on the bitmask's device. A row that allows nothing (a node the
    grammar rejected, whose logits are never read) forbids nothing."""
    if bitmask.device.type == "cpu":  # in numpy, one thread: a step's few rows cost microseconds
        words = bitmask.numpy()
        dead = ~words.any(axis=1)
        if dead.any():
            words = words.copy()
            words[dead] = -1
        bits = np.unpackbits(np.invert(words.view(np.uint8)), axis=-1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)[:, :vocab_size]
    return forbidden_tokens_on_device(bitmask, vocab_size)


def forbidden_tokens_on_device(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`forbidden_tokens` in torch ops on the bitmask's device (a GPU's; on a CPU numpy is quicker)."""
    n = bitmask.shape[0]
    lut = _FORBIDDEN_BITS.get(bitmask.device)
    if lut is None:  # byte value -> its 8 bits, inverted, least significant first
        lut = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).eq(0).to(bitmask.device)
        _FORBIDDEN_BITS[bitmask.device] = lut
    forbidden = lut.index_select(0, bitmask.view(torch.uint8).view(-1).int()).view(n, -1)[:, :vocab_size]
    return forbidden & ~forbidden.all(-1, keepdim=True)


def apply_grammar(logits: torch.Tensor, forbidden: torch.Tensor) -> None:
    """In place: the tokens a grammar forbids at each node get -inf. logits, forbidden: (N, V)."""
    logits.masked_fill_(forbidden, float("-inf"))
