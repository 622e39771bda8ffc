"""GPU benchmark: one script that runs as is on a CUDA machine (see bench/gpu/README.md).

Two parts, written to `<out>/gpu_bench.json` and printed as tables, or to one `--json` file:

  steps:    a model with random bf16 weights in a given shape (default Llama-3.1-8B) on the
            static KV cache: decode step time at batch 1..64 and tree-verify step time at
            8/16/32/64 tree tokens, CUDA graphs on and off, against the HBM bandwidth limit
            (bytes of weights and of each request's KV read per step / measured device-to-device
            copy bandwidth).
  variants: the serving engine on a real model directory (the prepared SmolLM2 by default):
            tokens/s and accept length per algorithm on MT-bench first turns, graphs on (and off),
            pinned and adaptive shapes, and HF generate() with its static cache (`--hf-static`).

On CPU the same code runs (eager only, perf_counter timing) so the CPU suite keeps it working;
its numbers there mean nothing. This script does not install anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from specserve.config import EngineConfig, SpecConfig
from specserve.methods import method
from specserve.model_config import ModelConfig
from specserve.models.attention import make_attention_backend, resolve_attention
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel
from specserve.runtime.cuda_graph import GraphRunner
from specserve.runtime.plan import RuntimePlan

log = logging.getLogger("bench.gpu")

LLAMA_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
)
SHAPES = {
    "llama-3.1-8b": LLAMA_8B,
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "tiny": ModelConfig(  # for the CPU test of this script
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
    ),
}


def timer(device: torch.device, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median seconds per call of fn (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(device, lambda: dst.copy_(src), iters=10)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(cfg).to(dtype)  # no memory yet: an 8B model never exists in fp32
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
    model.use_fused_kernels(RuntimePlan.fused_on(device))  # the small ops as the engine runs them there
    return model.eval()


def weight_bytes_per_step(model: LlamaModel) -> int:
    """Bytes every forward reads: all weights but the embedding table (it reads B rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


@torch.inference_mode()
def bench_steps(cfg: ModelConfig, device: torch.device, batch_sizes: list[int], num_draft_tokens: list[int],
                context: int, iters: int, graphs: bool, attention: str = "auto",
                dump: Callable[[dict], None] = lambda report: None) -> dict:
    """Decode and verify step times of a random-weight model of shape `cfg`; `dump(report)` after
    each row (a timeout keeps what ran)."""
    dtype = torch.bfloat16
    model = random_model(cfg, dtype, device)
    max_bs = max(batch_sizes)
    cache = KVCache(cfg, max_bs + 1, context + max(num_draft_tokens) + 1, dtype, str(device))
    model.init_rope(cache.max_len)
    bandwidth = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**26)
    floor = weight_bytes_per_step(model) / bandwidth
    attention = resolve_attention(attention, device, dtype)
    # the KV cache each request reads per step: every layer's K and V over the context
    kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * context * dtype.itemsize
    report = {"shape": asdict(cfg), "attention": attention, "context": context,
              "weight_bytes": weight_bytes_per_step(model),
              "kv_bytes_per_request": kv_bytes, "copy_bandwidth_gbs": bandwidth / 1e9,
              "bandwidth_floor_ms": floor * 1e3, "decode": [], "verify": []}

    def backend(bs: int, t: int, capture: bool):  # noqa: ANN202
        return make_attention_backend(attention, cfg, cache.max_len, dtype, device, bs if capture else None, t)

    def time_step(row: dict, name: str, bs: int, t: int, capture: bool) -> None:
        """row[name_ms]: the step's median time; with capture, whether its graph was captured and
        its capture failures (a failed capture runs eagerly: its time is no graph's)."""
        runner = GraphRunner(model, cache, [bs], [t], (), padding_slot=max_bs,
                             make_backend=lambda b, n: backend(b, n, capture), capture=capture)
        slots = torch.arange(bs, device=device)
        lens = torch.full((bs,), context, device=device)
        tokens = torch.randint(0, cfg.vocab_size, (bs, t), device=device)
        positions = lens[:, None] + torch.arange(t, device=device)
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(bs, t, t)  # a chain of t nodes
        host = [context] * bs
        row[f"{name}_ms"] = timer(device, lambda: runner.forward(tokens, positions, slots, lens,
                                                                 mask if t > 1 else None, host), iters) * 1e3
        if capture:
            row["graph_captured"] = runner.num_captured == 1
            row["capture_failures"] = len(runner.failures.keys)

    modes = [("eager", False)] + ([("graph", True)] if graphs else [])
    for bs in batch_sizes:
        row = {"batch_size": bs}
        for name, capture in modes:
            time_step(row, name, bs, 1, capture)
        best = min(row[f"{n}_ms"] for n, _ in modes)
        row["bandwidth_floor_ms"] = (floor + bs * kv_bytes / bandwidth) * 1e3  # weights once, each request's KV
        row["vs_bandwidth_floor"] = best / row["bandwidth_floor_ms"]
        report["decode"].append(row)
        log.info("decode bs=%d %s", bs, row)
        dump(report)
    decode_bs1 = report["decode"][0]
    for t in num_draft_tokens:
        row = {"batch_size": 1, "num_draft_tokens": t}
        for name, capture in modes:
            time_step(row, name, 1, t, capture)
            row[f"{name}_vs_decode"] = row[f"{name}_ms"] / decode_bs1[f"{name}_ms"]
        report["verify"].append(row)
        log.info("verify t=%d %s", t, row)
        dump(report)
    return report


def graph_report(engine: object) -> dict:
    """What an engine captured: its target's and its drafter's CUDA-graph buckets and capture
    failures (a failed bucket runs eagerly), their sum, and `cuda_graph` when the target replays
    at least one graph."""
    row = {}
    for name, graphs in (("target", engine.runner.graphs), ("drafter", engine.drafter.graphs)):
        row[f"{name}_graphs"] = 0 if graphs is None else graphs.num_captured
        row[f"{name}_capture_failures"] = 0 if graphs is None else len(graphs.failures.keys)
    row["capture_failures"] = row["target_capture_failures"] + row["drafter_capture_failures"]
    row["cuda_graph"] = row["target_graphs"] > 0
    return row


def bench_variants(model_dir: str, device: torch.device, algorithms: list[str], num_prompts: int,
                   max_new_tokens: int, graphs: bool, adaptive: bool = True, hf_static: bool = False,
                   eager_too: bool = True, dump: Callable[[list[dict]], None] = lambda rows: None,
                   dataset: str = "mtbench") -> list[dict]:
    """Per algorithm: tokens/s and accept length at batch 1, bf16, graphs on and off (CUDA), with the
    algorithm's pinned shape and (adaptive) its adaptive one; `hf_static`: HF generate() with its
    static cache as the baseline. `dump(rows)` after each row (a timeout keeps what ran). `dataset`:
    the prompts' source (`specserve.prompts.load_questions`)."""
    from tokenizers import Tokenizer

    from specserve.bench import run_engine
    from specserve.engine.engine import Engine
    from specserve.prompts import load_questions, render_chat
    from specserve.serving.repository import served_drafter

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    prompts = [tok.encode(render_chat(model_dir, q), add_special_tokens=False).ids
               for q in load_questions(dataset, num_prompts)]
    # a GPU runs CUDA graphs; the CPU's compiled programs are not this script's subject (on a CPU, its tests)
    base = EngineConfig(model_dir=model_dir, max_batch_size=1, max_seq_len=2048, device=str(device), cpu_compile=False)
    rows = []
    for alg in algorithms:
        shapes = {"pinned": pinned_shape(alg)}
        if adaptive and method(alg).drafts:
            shapes["adaptive"] = {}
        for shape_name, shape in shapes.items():
            spec = SpecConfig(algorithm=alg, **served_drafter(alg), **shape)
            for mode in (["auto", "off"] if graphs and eager_too else ["auto"] if graphs else ["off"]):
                start = time.perf_counter()
                engine = Engine(replace(base, spec=spec, graph_mode=mode))
                startup_s = time.perf_counter() - start
                run = run_engine(engine, prompts, max_new_tokens)
                rows.append({"algorithm": alg, "shape": shape_name, "graph_mode": mode, **graph_report(engine),
                             "startup_s": round(startup_s, 2), "attention": engine.runner.attention,
                             "tokens_per_s": run["tokens_per_s"], "accept_length": run["accept_length"],
                             "profile_ms": engine.profile.per_step_ms()})
                log.info("%s", rows[-1])
                dump(rows)
                del engine
    if hf_static:
        rows.append(hf_static_generate(model_dir, device, prompts, max_new_tokens))
        log.info("%s", rows[-1])
        dump(rows)
    return rows


def pinned_shape(algorithm: str) -> dict[str, int]:
    """The tree a pinned run uses: the method's default, with 8 draft tokens where it sets none of
    its own (NGRAM's chain of 8 instead of 12; the heads' 5/4/8; MTP's 1/2/3); {} for `none`."""
    m = method(algorithm)
    if not m.drafts:
        return {}
    steps, topk, tokens = m.shape(0, 0, 0 if m.is_head else 8)
    return {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens}


def hf_static_generate(model_dir: str, device: torch.device, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """transformers' greedy generate() in bf16 with its static cache (which it compiles), one prompt at
    a time, after one untimed run: the baseline a user gets from transformers alone. One cache, as
    long as the longest prompt plus the answer, serves every prompt (reset in between), so its
    forward compiles once rather than once per cache length."""
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    cache_len = max(map(len, prompts)) + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=cache_len)

    def run(ids: list[int]) -> int:
        cache.reset()
        x = torch.tensor([ids], device=device)
        out = model.generate(x, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             past_key_values=cache)
        return out.shape[1] - len(ids)

    run(prompts[0])
    start = time.perf_counter()
    tokens = sum(run(p) for p in prompts)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"algorithm": "hf_generate_static_cache", "tokens_per_s": tokens / (time.perf_counter() - start),
            "cache_len": cache_len}


def capture_failures(report: dict) -> int:
    """The capture failures a report's rows count (steps and variants)."""
    steps = report.get("steps", {})
    rows = [*steps.get("decode", []), *steps.get("verify", []), *report.get("variants", [])]
    return sum(r.get("capture_failures", 0) for r in rows)


def summarize(out: Path) -> str:
    """One line for the check's summary: the capture failures of every JSON report in `out`, per file."""
    counts = {}
    for path in sorted(out.glob("*.json")):
        try:
            counts[path.name] = capture_failures(json.loads(path.read_text()))
        except (OSError, ValueError) as e:  # a part cut mid-write: say so, count nothing
            counts[path.name] = f"unreadable ({type(e).__name__})"
    total = sum(c for c in counts.values() if isinstance(c, int))
    return f"capture failures: {total} (" + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")"


def markdown(report: dict) -> str:
    lines = []
    if "steps" in report:
        s = report["steps"]
        lines += [f"decode/verify steps, {report['device']}, {s['attention']} attention, context {s['context']}, "
                  f"weights {s['weight_bytes'] / 1e9:.2f} GB, copy {s['copy_bandwidth_gbs']:.0f} GB/s, "
                  f"floor {s['bandwidth_floor_ms']:.3f} ms", ""]
        cols = [c for c in s["decode"][0] if c != "batch_size"]
        lines += ["| batch | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {r['batch_size']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |" for r in s["decode"]]
        cols = [c for c in s["verify"][0] if c not in ("batch_size", "num_draft_tokens")]
        lines += ["", "| tree tokens | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {r['num_draft_tokens']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |" for r in s["verify"]]
    if "variants" in report:
        lines += ["", "| algorithm | CUDA graph | attention | tok/s | accept length |", "|---|---|---|---:|---:|"]
        lines += [f"| {r['algorithm']} | {r['cuda_graph']} | {r['attention']} | {r['tokens_per_s']:.1f} | "
                  f"{r['accept_length']:.2f} |" for r in report["variants"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/gpu/results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--num-draft-tokens", default="8,16,32,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model-dir", default=None, help="for the variants part (default: the prepared SmolLM2)")
    p.add_argument("--algorithms", default="none,ngram,eagle,eagle3,mtp,standalone")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--dataset", default="mtbench", help="variants: mtbench, or a JSONL of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-variants", action="store_true")
    p.add_argument("--attention", default="auto", help="the steps part's attention backend")
    p.add_argument("--no-adaptive", action="store_true", help="variants: pinned shapes only")
    p.add_argument("--hf-static", action="store_true", help="variants: also HF generate() with its static cache")
    p.add_argument("--graphs-only", action="store_true", help="variants: no eager runs beside the graphs")
    p.add_argument("--json", default=None, help="write the report to this one file (no --out folder)")
    p.add_argument("--summarize", default=None, metavar="DIR",
                   help="print the capture failures of the JSON reports in DIR, and run nothing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.summarize:
        print(summarize(Path(args.summarize)))
        return 0

    device = torch.device(args.device)
    graphs = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if graphs else "cpu"
    report: dict = {"device": name, "torch": torch.__version__}
    if not args.skip_steps:
        def dump_steps(steps: dict) -> None:
            if args.json:
                Path(args.json).write_text(json.dumps(report | {"steps": steps}, indent=2) + "\n")

        report["steps"] = bench_steps(SHAPES[args.shape], device, [int(b) for b in args.batch_sizes.split(",")],
                                      [int(t) for t in args.num_draft_tokens.split(",")], args.context, args.iters,
                                      graphs, args.attention, dump_steps)
    if not args.skip_variants:
        from specserve.prepare import default_model_dir

        model_dir = args.model_dir or str(default_model_dir())
        if Path(model_dir, "config.json").is_file():
            def dump(rows: list[dict]) -> None:
                if args.json:
                    Path(args.json).write_text(json.dumps(report | {"variants": rows}, indent=2) + "\n")

            report["variants"] = bench_variants(model_dir, device, args.algorithms.split(","), args.num_prompts,
                                                args.max_new_tokens, graphs, not args.no_adaptive, args.hf_static,
                                                not args.graphs_only, dump, args.dataset)
        else:
            log.warning("variants: no model at %s (prepare it, or pass --model-dir); skipped", model_dir)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "gpu_bench.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
