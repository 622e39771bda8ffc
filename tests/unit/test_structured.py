"""Structured outputs: the request forms, xgrammar compiled for the served tokenizer, the per-node
masks of a draft tree, and speculative engines (float32) giving plain decoding's output under a grammar."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

import specserve_kernels as K
from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.grammar import GrammarCompiler, choice_ebnf, paying_forced, without_forbidden
from specserve.engine.sampling import forbidden_tokens, forbidden_tokens_on_device, greedy_tokens, masked_greedy_token
from specserve.grammar import GrammarSpec, from_trtllm, from_vllm
from specserve.serving.contract import RequestError, RequestLimits
from specserve.serving.parsing import decode_request_config, encode_request_config, parse_request
from specserve.tree import DraftTree, TreeBatch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["red", "blue"]}}}}


# ---- request forms ----------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "kind", "value"), [
    ({"json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    (json.dumps({"json": SCHEMA}), "json_schema", json.dumps(SCHEMA)),  # as Triton's OpenAI frontend sends it
    ({"json_object": True}, "json_object", ""),
    ({"regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"grammar": 'root ::= "a"', "backend": "xgrammar", "disable_fallback": True}, "ebnf", 'root ::= "a"'),
])
def test_vllm_forms(raw, kind, value):
    spec = from_vllm(raw, "structured_outputs")
    assert (spec.kind, spec.value, spec.any_whitespace) == (kind, value, False)


def test_vllm_free_whitespace_only_when_asked():
    assert from_vllm({"json": SCHEMA, "disable_any_whitespace": False}, "x").any_whitespace
    assert not from_vllm({"json": SCHEMA, "disable_any_whitespace": True}, "x").any_whitespace


@pytest.mark.parametrize(("raw", "error"), [
    ({}, "set exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "set exactly one of"),
    ({"regex": "a", "flavour": 1}, "x.flavour: unknown parameter"),
    ({"regex": "a", "structural_tag": "{}"}, "x.structural_tag: only null supported"),
    ({"json": "{not json"}, "x.json: the schema is not valid JSON"),
    ({"json": [1]}, "x.json: expected a JSON schema"),
    ({"choice": []}, "x.choice: must be 1 to 256 non-empty strings"),
    ({"choice": "yes"}, "x.choice: expected a list"),
    ({"choice": ["a", ""]}, "x.choice: must be 1 to 256 non-empty strings"),
    ({"json_object": "yes"}, "x.json_object: expected true"),
    ({"regex": 5}, "x.regex: expected a string"),
    ("[1, 2]", "x: expected an object"),
    ("{oops", "x: not valid JSON"),
])
def test_vllm_form_errors_name_the_field(raw, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace("[", r"\[")):
        from_vllm(raw, "x")


def test_trtllm_forms():
    assert from_trtllm("json_schema", json.dumps(SCHEMA)).kind == "json_schema"
    assert from_trtllm("json", None) == GrammarSpec("json_object")
    assert from_trtllm("regex", "a+").value == "a+"
    assert from_trtllm("ebnf_grammar", 'root ::= "b"').kind == "ebnf"
    assert from_trtllm("none", None) is None
    with pytest.raises(ValueError, match="guided_decoding_guide_type: must be one of"):
        from_trtllm("lark", "x")
    with pytest.raises(ValueError, match="guided_decoding_guide: missing"):
        from_trtllm("regex", "")


def _bytes(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_parse_request_carries_the_grammar_through_both_models():
    limits = RequestLimits()
    for key in ("structured_outputs", "guided_decoding"):
        parsed = parse_request({"text_input": _bytes("hi"),
                                "sampling_parameters": _bytes(json.dumps({key: {"regex": "[ab]+"}}))}, limits)
        assert parsed.request.params.structured_output == GrammarSpec("regex", "[ab]+")
    parsed = parse_request({"text_input": _bytes("hi"), "guided_decoding_guide_type": _bytes("json_schema"),
                            "guided_decoding_guide": _bytes(json.dumps(SCHEMA))}, limits)
    request = parsed.request
    # preprocessing -> llm_<variant>: the spec travels in request_config and comes back equal
    assert decode_request_config(encode_request_config(request)[0], limits) == request
    with pytest.raises(RequestError, match="conflicts with sampling_parameters.structured_outputs"):
        parse_request({"text_input": _bytes("hi"), "guided_decoding_guide_type": _bytes("regex"),
                       "guided_decoding_guide": _bytes("a"),
                       "sampling_parameters": _bytes(json.dumps({"structured_outputs": {"regex": "b"}}))}, limits)
    with pytest.raises(RequestError, match="not both"):
        parse_request({"text_input": _bytes("hi"), "sampling_parameters": _bytes(json.dumps(
            {"structured_outputs": {"regex": "b"}, "guided_decoding": {"regex": "b"}}))}, limits)


def test_forged_request_config_grammar_is_checked():
    limits = RequestLimits()
    for forged, error in [({"kind": "python", "value": "import os"}, "structured_output.kind: must be one of"),
                          ({"kind": "regex", "value": "", "any_whitespace": False}, "structured_output.value: "),
                          ({"kind": "regex", "value": "a", "code": 1}, "expected an object of kind")]:
        payload = json.dumps({"params": {"structured_output": forged}, "stream": False})
        with pytest.raises(RequestError, match=error):
            decode_request_config(payload.encode(), limits)


# ---- compiling ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(smollm2_dir):
    return GrammarCompiler(str(smollm2_dir), 49152, [2], max_bytes=4096, timeout_s=5.0)


def test_compile_errors_are_the_clients(compiler):
    with pytest.raises(ValueError, match=r"^structured_output: the regex does not compile: Regex parsing error"):
        compiler.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(ValueError, match=r"structured_output: the json_schema does not compile: Unsupported type"):
        compiler.compile(GrammarSpec("json_schema", '{"type": "spaceship"}'))
    with pytest.raises(ValueError, match="more than structured_output_max_bytes"):
        compiler.compile(GrammarSpec("regex", "a" * 5000))


def test_a_slow_compile_is_refused_at_the_timeout(compiler, monkeypatch):
    import specserve.engine.grammar as grammar

    monkeypatch.setattr(grammar, "_compile", lambda c, s: time.sleep(3))
    monkeypatch.setattr(compiler, "timeout_s", 0.2)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="did not compile within 0.2 s"):
        compiler.compile(GrammarSpec("regex", "slow"))
    assert time.perf_counter() - start < 1.0


def test_choice_grammar_matches_exactly_one_choice(compiler):
    compiled = compiler.compiler().compile_grammar(choice_ebnf(['say "hi"', "café", "a\\b"]))
    for text, ok in [('say "hi"', True), ("café", True), ("a\\b", True), ("caf", False), ('say "hi"!', False)]:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


# ---- masks over a draft tree ---------------------------------------------------------------------


def _allowed_after(compiler, spec, path: list[int]) -> torch.Tensor | None:
    """Reference: a fresh matcher fed `path` token by token, then its mask (None: the path is rejected)."""
    match = compiler.match(spec)
    for t in path:
        if not match.accept(t):
            return None
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    match.matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, 49152)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return logits[0].isfinite()


def test_tree_masks_equal_each_paths_own_mask(compiler, smollm2_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    ids = tok.encode('{"name": "Al', add_special_tokens=False).ids
    bad = tok.encode("x", add_special_tokens=False).ids[0]
    match = compiler.match(spec)
    assert match.accept(ids[0])  # the root: the last emitted token
    assert len(ids) == 5, ids  # '{"', 'name', '":', ' "', 'Al'
    # root -> ids[1] -> ids[2] -> ids[3] -> ids[4]; root -> bad -> ids[2]; ids[1] -> bad
    tokens = [ids[0], ids[1], bad, ids[2], ids[2], bad, ids[3], ids[4]]
    parents = [-1, 0, 0, 1, 2, 1, 3, 6]
    tree = DraftTree.from_parents(tokens, parents)
    batch = TreeBatch.from_trees([tree])
    allowed = ~forbidden_tokens(match.bitmask(batch.tokens[0], batch.first_child[0], batch.next_sibling[0]), 49152)
    for node in range(len(tokens)):
        path, i = [], node
        while i > 0:
            path.append(tokens[i])
            i = parents[i]
        want = _allowed_after(compiler, spec, [ids[0], *reversed(path)])
        if want is None:  # a rejected node (or below one): everything, its logits are never read
            assert bool(allowed[node].all()), node
        else:
            assert torch.equal(allowed[node], want), node
    assert allowed[:, bad].sum() >= 1 and not allowed[0, bad]
    assert match.accept(ids[1]), "the traversal left the matcher where it was"


def _json_tree(compiler, smollm2_dir):
    """The tree above: root '{"' -> 'name' -> '":' -> ' "' -> 'Al', with a forbidden token below the
    root and below 'name' (and one node under the first)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    ids = tok.encode('{"name": "Al', add_special_tokens=False).ids
    bad = tok.encode("x", add_special_tokens=False).ids[0]
    match = compiler.match(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert match.accept(ids[0])
    tokens = [ids[0], ids[1], bad, ids[2], ids[2], bad, ids[3], ids[4]]
    parents = [-1, 0, 0, 1, 2, 1, 3, 6]
    return match, ids, bad, tokens, parents


def test_forbidden_drafts_are_pruned_before_verification(compiler, smollm2_dir):
    match, ids, bad, tokens, parents = _json_tree(compiler, smollm2_dir)
    assert match.allowed_nodes(tokens, parents) == [0, 1, 3, 6, 7]
    plain = DraftTree.chain(5, [6, 7])  # a row without a grammar keeps its tree
    batch, kept = without_forbidden(TreeBatch.from_trees([DraftTree.from_parents(tokens, parents), plain]),
                                    [match, None])
    assert kept == [[0, 1, 3, 6, 7], [0, 1, 2]]
    assert batch.num_draft_tokens.tolist() == [5, 3]
    assert batch.tokens[0].tolist() == [ids[0], ids[1], ids[2], ids[3], ids[4]]
    assert batch.parents[0].tolist() == [-1, 0, 1, 2, 3] and batch.tokens[1, :3].tolist() == [5, 6, 7]
    allowed_only = TreeBatch.from_trees([DraftTree.chain(ids[0], ids[1:4])])
    assert without_forbidden(allowed_only, [match])[1] is None  # nothing forbidden: the batch as it was
    assert match.accept(ids[1]), "pruning left the matcher where it was"


@pytest.mark.parametrize("forbidden_argmax_at", [None, 1, 3])
def test_greedy_targets_mask_only_where_the_path_needs_it(compiler, smollm2_dir, forbidden_argmax_at):
    """The lazily masked targets accept what the fully masked ones do, and fill a mask only where the
    unmasked argmax on the accepted path is one the grammar forbids."""
    match, ids, bad, tokens, parents = _json_tree(compiler, smollm2_dir)
    tree = TreeBatch.from_trees([DraftTree.from_parents(tokens, parents)])
    logits = torch.randn(len(tokens), 49152, generator=torch.Generator().manual_seed(0))
    for node, nxt in ((0, ids[1]), (1, ids[2]), (3, ids[3]), (6, ids[4])):  # the target agrees along the path
        logits[node, nxt] = 20.0
    logits[7, 2] = 20.0  # the bonus token's node prefers EOS, which the unfinished object forbids
    if forbidden_argmax_at is not None:  # its unmasked argmax is forbidden; the allowed runner-up stands
        logits[forbidden_argmax_at, bad] = 30.0
    masked = logits.clone()
    bitmask = match.bitmask(tree.tokens[0], tree.first_child[0], tree.next_sibling[0])
    masked.masked_fill_(forbidden_tokens(bitmask, 49152), float("-inf"))
    want = K.verify_greedy(tree.tokens, tree.first_child, tree.next_sibling, masked.argmax(-1)[None])
    targets = logits.argmax(-1)
    filled = match.greedy_targets(tokens, tree.first_child[0].tolist(), tree.next_sibling[0].tolist(), logits, targets)
    got = K.verify_greedy(tree.tokens, tree.first_child, tree.next_sibling, targets[None])
    assert got.accepted_nodes.tolist() == want.accepted_nodes.tolist() == [[0, 1, 3, 6, 7, -1, -1, -1]]
    assert got.bonus_tokens.tolist() == want.bonus_tokens.tolist()
    assert filled == (0 if forbidden_argmax_at is None else 1) + 1  # and node 7's
    assert match.accept(ids[1]), "the walk left the matcher where it was"


def test_greedy_targets_stop_where_the_grammar_ends(compiler, smollm2_dir):
    """A drafted EOS the target agrees with ends the grammar: the walk stops there and fills no mask
    for the nodes below it (xgrammar refuses a terminated matcher's mask), and pruning drops them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    match = compiler.match(GrammarSpec("choice", json.dumps(["yes"])))
    ids = tok.encode("yes", add_special_tokens=False).ids
    for t in ids:
        assert match.accept(t)
    tokens, parents = [ids[-1], 2, 17], [-1, 0, 1]  # root -> EOS -> a token after the end
    tree = TreeBatch.from_trees([DraftTree.from_parents(tokens, parents)])
    logits = torch.zeros(3, 49152)
    logits[0, 2] = logits[1, 17] = 10.0
    targets = logits.argmax(-1)
    match.greedy_targets(tokens, tree.first_child[0].tolist(), tree.next_sibling[0].tolist(), logits, targets)
    got = K.verify_greedy(tree.tokens, tree.first_child, tree.next_sibling, targets[None])
    assert got.accepted_nodes[0, :2].tolist() == [0, 1]
    assert match.allowed_nodes(tokens, parents) == [0, 1]  # nothing below the stop token is verified
    assert not match.terminated and match.accept(2), "the walk left the matcher where it was"


@settings(max_examples=300, deadline=None)
@given(vocab=st.integers(1, 200), words=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       density=st.sampled_from([0.0, 0.02, 0.5, 1.0]), levels=st.sampled_from([0, 3]), dead=st.booleans())
def test_the_masked_greedy_token_is_the_argmax_of_the_masked_logits(vocab, words, seed, density, levels, dead):
    """Against masking the whole vocabulary and taking `greedy_tokens`: sparse and dense masks, equal
    maxima (few distinct values), -inf logits, a vocabulary that is not whole words, bits past it, and
    a bitmask narrower than the vocabulary (the tokens past it forbidden)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) if not levels else torch.randint(levels, (vocab,), generator=g).float()
    if dead:
        logits[torch.rand(vocab, generator=g) < 0.5] = float("-inf")
    width = words if words <= 2 else max(words, -(-vocab // 32))  # 1-2 words: narrower than most vocabularies
    bits = torch.rand(width * 32, generator=g) < density
    bitmask = torch.from_numpy(np.packbits(bits.numpy(), bitorder="little").view(np.int32).copy())
    allowed = torch.cat([bits, torch.zeros(max(0, vocab - len(bits)), dtype=torch.bool)])[:vocab]
    got = masked_greedy_token(logits, bitmask)
    if not allowed.any():
        assert got == 0
        return
    masked = logits.masked_fill(~allowed, float("-inf"))
    want = int(greedy_tokens(masked))
    if masked[want] == float("-inf"):  # every allowed one at -inf: the first allowed
        want = int(allowed.nonzero()[0])
    assert got == want


def test_the_device_unpacking_equals_the_host_one():
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    words[1] = 0  # a rejected node: forbids nothing
    assert torch.equal(forbidden_tokens_on_device(words, 100), forbidden_tokens(words, 100))
    assert not forbidden_tokens(words, 100)[1].any() and forbidden_tokens(words, 100)[0].any()


def test_forced_tokens_spell_the_jump_forward_string(compiler, smollm2_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    match = compiler.match(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    forced = match.forced(encode, limit=16)
    assert tok.decode(forced) == '{"name": "'
    assert match.forced(encode, limit=2) == forced[:2]
    assert not match.accept(2), "forced() left the matcher at the start, where EOS is not allowed"
    for t in forced:
        assert match.accept(t)
    assert match.forced(encode, limit=16) == []  # inside the name's string: nothing is forced


def test_forced_text_is_drafted_as_the_request_spelled_it_before(compiler, smollm2_dir):
    """A model under a grammar may spell forced text its own way; the next time the same text is
    forced, in this request or a later one of its cache salt, it is drafted as the model spelled it
    last; a request of another salt drafts the tokenizer's spelling."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    match = compiler.match(GrammarSpec("ebnf", 'root ::= "items" ("x" | "y") "items" ("x" | "y") "items"'))
    assert match.forced(encode, limit=8) == encode("items") == [tok.token_to_id("items")]
    own = [tok.token_to_id(t) for t in ("i", "te", "ms")]  # the model's own spelling of the forced text
    for t in [*own, tok.token_to_id("x")]:
        assert match.accept(t)
    assert match.forced(encode, limit=8) == own
    assert match.forced(encode, limit=2) == own[:2]
    grammar = GrammarSpec("ebnf", 'root ::= "items" ("x" | "y") "items" ("x" | "y") "items"')
    assert compiler.match(grammar).forced(encode, limit=8) == own  # a later request of the same (no) salt
    assert compiler.match(grammar, cache_salt="tenant-b").forced(encode, limit=8) == encode("items")
    for t in [tok.token_to_id("items"), tok.token_to_id("y")]:  # spelled as encoded: that spelling is kept
        assert match.accept(t)
    assert match.forced(encode, limit=8) == encode("items")


# ---- engines -----------------------------------------------------------------------------------


def _engine(tiny_target_dir, algorithm: str, batch: int, jump_forward: bool = True) -> Engine:
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=batch, max_seq_len=256, structured_output_jump_forward=jump_forward,
                               spec=SpecConfig(algorithm=algorithm, adaptive=False)))


PROMPTS = [[int(t) for t in torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n))] * 3
           for n in (4, 7, 5)]
GRAMMARS = [GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", "(ab|cd)+[0-9]{2,40}"),
            GrammarSpec("choice", json.dumps(["alpha beta gamma", "delta"]))]


@pytest.mark.parametrize("algorithm", ["none", "ngram", "standalone"])
def test_speculation_under_a_grammar_equals_plain_decoding_under_it(tiny_target_dir, algorithm):
    """Plain decoding under the grammar (masks only) against each method with the forced text drafted."""
    params = [SamplingParams(max_tokens=40, structured_output=g, logprobs=1) for g in GRAMMARS]
    ref = _engine(tiny_target_dir, "none", 3, jump_forward=False).generate(PROMPTS, params)
    outs = _engine(tiny_target_dir, algorithm, 3).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.num_accepted_tokens for o in outs) > 0, "forced text or drafts were accepted"
    assert sum(r.num_accepted_tokens for r in ref) == 0
    for o, r in zip(outs, ref):
        for tok, got, want in zip(o.token_ids, o.logprobs, r.logprobs):
            assert got[tok][0] == pytest.approx(want[tok][0], abs=1e-4)
    assert ref[2].finish_reason == "stop" and ref[2].text in ("alpha beta gamma", "delta")
    plain = _engine(tiny_target_dir, "none", 3).generate(PROMPTS, SamplingParams(max_tokens=40))
    assert [o.token_ids for o in plain] != [r.token_ids for r in ref], "the grammar changed the output"


@pytest.mark.parametrize("algorithm", ["none", "ngram", "standalone"])
def test_masks_on_the_accepted_path_and_pruned_drafts_equal_full_masks(tiny_target_dir, algorithm):
    """Greedy rows without logprobs are masked only where their accepted path needs it, and drafts
    the grammar forbids are pruned before the forward; the reference masks every node (logprobs)."""
    full = [SamplingParams(max_tokens=40, structured_output=g, logprobs=0) for g in GRAMMARS]
    ref = _engine(tiny_target_dir, "none", 3, jump_forward=False).generate(PROMPTS, full)
    engine = _engine(tiny_target_dir, algorithm, 3)
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=40, structured_output=g) for g in GRAMMARS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    if algorithm != "none":
        assert engine.profile.grammar_pruned > 0, "the drafter proposed nothing the grammars forbid"


@pytest.mark.parametrize("rows", [1, 2])
def test_forced_text_stays_within_the_step_programs_rows(tiny_target_dir, monkeypatch, rows):
    """On a CPU with compiled programs a request's forced text is cut to the tokens the step
    program's rows leave it (`TargetRunner.few_rows`): one row each drafts none, two at most one."""
    engine = _engine(tiny_target_dir, "none", 3)
    monkeypatch.setattr(engine.runner, "few_rows", lambda batch_size, share=1.0: rows)
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=20, structured_output=g) for g in GRAMMARS])
    assert max(n for o in outs for n in o.accept_lengths) == rows


def test_forced_text_is_cut_where_its_rows_do_not_pay():
    """The depth with the most tokens per expected second of the step; unknown seconds keep it all."""
    assert paying_forced([[5], [], [], []], [10.0, 16.0]) == [[], [], [], []]  # 5 tokens in 16 < 4 in 10
    assert paying_forced([[5, 6, 7]], [7.0, 7.9, 9.1, 9.8]) == [[5, 6, 7]]  # batch 1: every forced token pays
    assert paying_forced([[1, 2, 3], [4], [5, 6]], [10.0, 11.0, 12.0, 30.0]) == [[1, 2], [4], [5, 6]]
    assert paying_forced([[1], [2]], [10.0, None]) == [[1], [2]]  # depth 1 not measured yet: the step measures it
    assert paying_forced([[1], []], [None, None]) == [[1], []]  # no timed paths (a GPU)
    assert paying_forced([[], []], [10.0]) == [[], []]


@pytest.mark.parametrize(("costs", "forced_taken"), [([0.01] * 64, True), ([0.01 * (1 + d) for d in range(64)], False)])
def test_the_engine_verifies_forced_text_only_where_it_pays(tiny_target_dir, monkeypatch, costs, forced_taken):
    """A step's forced text is cut by `paying_forced` against the step's expected seconds: flat ones
    take it all, seconds that grow with every token a request take none (3 rows, never all forced)."""
    engine = _engine(tiny_target_dir, "none", 3)
    monkeypatch.setattr(engine, "_step_cost", lambda batch_size, max_rows: costs[:max_rows])
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=20, structured_output=g) for g in GRAMMARS])
    assert (max(n for o in outs for n in o.accept_lengths) > 1) == forced_taken


def test_a_grammar_output_validates_and_masked_logprobs(tiny_target_dir):
    import jsonschema

    engine = _engine(tiny_target_dir, "none", 1)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=120, structured_output=GRAMMARS[0], logprobs=0))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.token_ids[-1] in engine.eos_ids  # EOS where the grammar ended, and nowhere before
    assert all(lp[t][0] <= 0 for t, lp in zip(out.token_ids, out.logprobs))


def test_a_grammar_ends_before_min_tokens(tiny_target_dir):
    engine = _engine(tiny_target_dir, "none", 1)
    choice = GrammarSpec("choice", json.dumps(["delta"]))
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=30, min_tokens=20, structured_output=choice))[0]
    assert out.text == "delta" and out.finish_reason == "stop"


def test_sampled_output_under_a_grammar_stays_in_it(tiny_target_dir):
    import re

    regex = GRAMMARS[1]
    for algorithm in ("none", "ngram"):
        engine = _engine(tiny_target_dir, algorithm, 3)
        outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=24, temperature=1.0, seed=s, structured_output=regex)
                                         for s in range(3)])
        for o in outs:
            text = o.text
            assert re.fullmatch(r"(ab|cd)+[0-9]{0,40}", text) or re.fullmatch(r"(ab|cd)*(a|c)?", text), text


def test_engine_refuses_a_bad_grammar_before_queueing(tiny_target_dir):
    engine = _engine(tiny_target_dir, "none", 1)
    with pytest.raises(ValueError, match="structured_output: the regex does not compile"):
        engine.add_request(PROMPTS[0], SamplingParams(structured_output=GrammarSpec("regex", "[")))
    assert not engine.has_work()


def test_an_engine_without_structured_outputs_loads_no_xgrammar():
    """The GPU machine has no xgrammar: the engine imports it only with the first grammar."""
    import subprocess
    import sys

    code = "import sys, specserve.engine.engine, specserve.engine.verification; assert 'xgrammar' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("measured", [True, False])
def test_a_shape_untimed_under_a_grammar_is_timed_from_its_reshaped_steps(tiny_target_dir, monkeypatch, measured):
    """Forced text and pruned drafts change most steps' rows under a grammar, and such a step says nothing of
    its shape's own cost, except for a shape with no time yet: `ShapeChooser.best` runs an untimed shape first,
    and at batch 8 it ran step after step. It is timed with the forward's measured cost of the rows verified
    swapped for the drafter's (`Engine._as_drafted`); without measured forward costs it stays untimed."""
    engine = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                                 max_batch_size=3, max_seq_len=256, spec=SpecConfig(algorithm="ngram")))
    costs = [0.001 * rows if measured else None for rows in range(1, 65)]
    monkeypatch.setattr(engine.runner, "forward_seconds", lambda batch_size, max_rows: costs[:max_rows])
    assert engine._as_drafted(0.010, 3, 1, 4) == (pytest.approx(0.007) if measured else None)
    chooser = engine.chooser
    chooser.step_time = {key: type(t)(horizon=10, robust=True) for key, t in chooser.step_time.items()}  # untimed
    answers, timed = [], chooser.timed
    monkeypatch.setattr(chooser, "timed", lambda b, shape: answers.append(timed(b, shape)) or answers[-1])
    times, as_drafted = [], engine._as_drafted
    monkeypatch.setattr(engine, "_as_drafted", lambda *args: times.append(as_drafted(*args)) or times[-1])
    engine.generate(PROMPTS, [SamplingParams(max_tokens=30, structured_output=g) for g in GRAMMARS])
    assert answers.count(False) == len(times) > 0, "reshaped steps of untimed shapes, and only those, are timed"
    counts = [t.count for t in chooser.step_time.values()]
    if measured:
        assert all(t is not None for t in times) and max(counts) >= chooser.min_samples
    else:
        assert all(t is None for t in times)
