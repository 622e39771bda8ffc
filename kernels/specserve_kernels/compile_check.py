"""Compile every Triton kernel for real GPUs (sm_90, sm_80) on a machine without one.

    python -m specserve_kernels.compile_check --arch 90,80 --json compile_check.json

Each launcher is called as the engine calls it (the shapes of SmolLM2-135M and Llama-3.1-8B,
bfloat16 and float32, decode, tree verify of 4-64 tokens, a drafter's beam, catch-ups of a whole
prompt, batch sizes 1-64, caches spanning many splits) with empty CPU tensors, under a stand-in
driver that reports the GPU target. Triton's own JIT path then binds the arguments, specialises
them and chooses the kernel's constexprs exactly as on that GPU; a `jit_cache_hook` records each
distinct specialisation and stops the launch. Each is then compiled by Triton's real compiler (its
ptxas) to a cubin, and the check fails on:

    a compile error
    shared memory above the target's per-block limit (sm_90: 232,448 B, sm_80: 166,912 B)
    register spills in a bfloat16 decode or verify launch (T <= 16 new tokens); spills in other
        launches are reported, not failed. Spills are the stack frame `cuobjdump
        --dump-resource-usage` reads from the cubin (a Triton kernel has no other local memory).

What it does not do: run a kernel, so it finds no out-of-bounds access, race or wrong result (the
interpreter tests check results), no launch-time fault beyond shared memory and spills (e.g. a
grid dimension over 65,535), and no timing. It covers the launches of `launch_plan` only, and uses
the installed triton and ptxas: a GPU machine with another triton version compiles its own code.
The JSON lists each launch's specialisation keys, so a test can count the kernels a workload
compiles.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

import specserve_kernels as K
from specserve_kernels._launch import MAX_NODES
from specserve_kernels.tree_attention import Tiles

SHARED_LIMIT = {90: 232_448, 80: 166_912}  # bytes of shared memory one block may use
MAX_SEQ_LEN = 2048  # the engine's default: the longest prompt is 2047 tokens
BATCH_SIZES = (1, 8, 64)
TREE_SIZES = (4, 8, 16, 24, 32, MAX_NODES)  # 24: adaptive shapes draft trees of any size
CATCH_UP_TOKENS = (2, 17, 100, 129, 171, 342, 1000, 1024, 2047)
STRICT_TOKENS = 16  # bfloat16 launches of at most this many new tokens must not spill


@dataclass(frozen=True)
class ModelShape:
    """What the kernels see of a Llama model."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


MODELS = (
    ModelShape("SmolLM2-135M", 576, 9, 3, 64, 1536, 49152),
    ModelShape("Llama-3.1-8B", 4096, 32, 8, 128, 14336, 128256),
)
DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Launch:
    """One engine call of the launchers: `run()` calls them; `strict`: spills fail it."""

    label: str
    strict: bool
    run: Callable[[], None]


@dataclass
class Variant:
    """One specialisation of one kernel: what Triton would compile, and the launches that use it."""

    kernel: str
    key: str
    compile_args: tuple  # (JITFunction, signature, constexprs, attrs, options)
    labels: list[str] = field(default_factory=list)
    strict: bool = False


def missing_support() -> str | None:
    """Why the installed triton cannot run the check, or None."""
    try:
        from triton import knobs
    except ImportError:
        return f"triton {triton.__version__} has no triton.knobs"
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return f"triton {triton.__version__} has no knobs.runtime.jit_cache_hook"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        return f"triton {triton.__version__} lacks its CUDA backend: {e}"
    if not _cuobjdump().exists():
        return f"no cuobjdump at {_cuobjdump()}"
    return None


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


# ---- the engine's launches -----------------------------------------------------------------------


class Workload:
    """Empty CPU tensors shaped as the engine's for one model and dtype (pages never touched)."""

    def __init__(self, model: ModelShape, dtype: torch.dtype) -> None:
        self.m, self.dtype = model, dtype
        self.max_len = MAX_SEQ_LEN + MAX_NODES  # the cache: max_seq_len + the largest tree
        slots = max(BATCH_SIZES) + 1  # one spare slot, as the engine's static buckets
        # (1 layer, k/v, slots, Hkv, max_len, D): every stride is specialised as the full cache's
        # (multiples of 16), and all layers would not fit this machine's memory
        self.kv = torch.empty(1, 2, slots, model.kv_heads, self.max_len, model.head_dim, dtype=dtype)

    def empty(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype or self.dtype)

    def layer_step(self, b: int, t: int, cache_len: int, new_mask: torch.Tensor | None, key_len: int) -> None:
        """One fused layer of a forward of T new tokens per request (`LlamaModel._run_fused_layers`)."""
        m = self.m
        weight = self.empty(m.hidden)
        K.add_rms_norm(self.empty(b, t, m.hidden), self.empty(b, t, m.hidden), weight, 1e-5)
        slots = torch.arange(b)
        cache_lens = torch.full((b,), cache_len)
        write_pos = cache_lens[:, None] + torch.arange(t)  # (B, T)
        qkv = self.empty(b, t, (m.heads + 2 * m.kv_heads) * m.head_dim)
        cos, sin = self.empty(b, t, 1, m.head_dim), self.empty(b, t, 1, m.head_dim)
        k_cache, v_cache = self.kv[0, 0], self.kv[0, 1]  # (slots, Hkv, max_len, D)
        q = K.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots[:, None].expand(b, t), write_pos,
                            m.heads, m.kv_heads)  # (B, Hq, T, D)
        K.tree_attention(q, k_cache, v_cache, slots, cache_lens, new_mask, key_len)
        K.silu_mul(self.empty(b, t, 2 * m.intermediate))

    def verify_step(self, b: int, n: int) -> None:
        """A tree's build, greedy and sampled verification, and the accepted K/V's compaction."""
        long = torch.int64
        tree = K.build_tree(self.empty(b, n, dtype=long))
        links = (self.empty(b, n, dtype=long), tree.first_child, tree.next_sibling)
        K.verify_greedy(*links, self.empty(b, n, dtype=long))
        coins = self.empty(b, n + 1, dtype=torch.float32)
        probs = self.empty(b, n, self.m.vocab, dtype=torch.float32)
        result = K.verify_sample(*links, probs, coins[:, :-1].contiguous(), coins[:, -1].contiguous())
        K.compact_kv(self.kv, torch.arange(b), self.empty(b, dtype=long), result.accepted_nodes, result.accept_length)


def launch_plan(models: tuple[ModelShape, ...] = MODELS, dtypes: tuple[torch.dtype, ...] = DTYPES) -> Iterator[Launch]:
    """Every launch the engine makes, in kind: decode, tree verify, beam, catch-up, verification."""
    for model in models:
        for dtype in dtypes:
            yield from _model_launches(Workload(model, dtype))


def _model_launches(w: Workload) -> Iterator[Launch]:
    name = f"{w.m.name} {str(w.dtype).removeprefix('torch.')}"
    bf16 = w.dtype == torch.bfloat16
    cache_lens = (0, 100, 255, 256, 257, 700, 1024, 1500, w.max_len - 65)  # across several splits
    for b in BATCH_SIZES:
        for c in cache_lens:  # decode: causal, one token; eager (key_len = the live length)
            yield Launch(f"{name} decode B={b} cache={c}", bf16,
                         lambda b=b, c=c: w.layer_step(b, 1, c, None, c + 1))
        yield Launch(f"{name} decode B={b} graph", bf16,  # a captured step: the whole cache, a mask
                     lambda b=b: w.layer_step(b, 1, 300, torch.ones(b, 1, 1, dtype=torch.bool), w.max_len))
        for n in TREE_SIZES:
            strict = bf16 and n <= STRICT_TOKENS
            for c in (300, 1500):
                yield Launch(f"{name} verify T={n} B={b} cache={c}", strict,
                             lambda b=b, n=n, c=c: w.layer_step(b, n, c, _tree_mask(b, n), c + n))
            yield Launch(f"{name} verify T={n} B={b} graph", strict,
                         lambda b=b, n=n: w.layer_step(b, n, 300, _tree_mask(b, n), w.max_len))
            yield Launch(f"{name} verify step N={n} B={b}", strict, lambda b=b, n=n: w.verify_step(b, n))
    for k, steps in ((4, 3), (8, 5)):  # a drafter's beam: k nodes see some of the scratch entries
        for s in range(1, steps):
            width = (s - 1) * k + k
            visible = torch.empty(8, k, (steps - 1) * k, dtype=torch.bool)[:, :, :width]  # sliced, as grow_trees
            yield Launch(f"{name} beam k={k} step={s}", bf16,
                         lambda k=k, s=s, v=visible: w.layer_step(8, k, 400, v, 400 + (s - 1) * k + k))
    for t in CATCH_UP_TOKENS:  # catch-up after a prefix (or a whole prompt beside one): causal, no mask
        for b in (1, 8):
            yield Launch(f"{name} catch-up T={t} B={b}", bf16 and t <= STRICT_TOKENS,
                         lambda b=b, t=t: w.layer_step(b, t, MAX_SEQ_LEN - t, None, MAX_SEQ_LEN))


def _uncapped_tiles(rows: int, head_dim: int, dtype: torch.dtype) -> Tiles:
    """The tile of `tree_attention` before it had a row-block grid: every row in one block."""
    block_m = max(16, triton.next_power_of_2(rows))
    return Tiles(block_m, 64 if block_m <= 32 else 32)


FAULTS = {  # faults the check must catch, put back on demand (`--inject`) to show that it does
    # shared memory grows with T: a long catch-up fails
    "uncapped-tile": ("specserve_kernels.tree_attention", "_tiles", _uncapped_tiles),
    # bfloat16 through the float32 dot: spills
    "interpreter-dot": ("specserve_kernels.tree_attention", "interpreting", lambda: True),
    # RoPE's two products summed by one bfloat16 fma: not the eager forward's roundings
    "rope-fma": ("specserve_kernels.fused_layer", "ROPE_FP_FUSION", True),
}
# kernels whose bfloat16 results equal the eager ops' bit for bit: the roundings (bf16 arithmetic
# instructions) eager makes. RoPE: x * c, r * s, their sum (sm_80 writes each as an fma with 0 or 1).
ROUNDS_AS_EAGER = {"_rope_kv_write_kernel": 3}
BF16_OPS = re.compile(r"\b(?:mul|add|sub|fma)(?:\.rn)?\.bf16\b")


def inject(fault: str) -> None:
    """Put `fault` (a FAULTS name) back for this process."""
    module, name, replacement = FAULTS[fault]
    setattr(importlib.import_module(module), name, replacement)


def _tree_mask(b: int, n: int) -> torch.Tensor:
    """(B, N, N) bool, as `build_tree` returns its trees' masks."""
    return torch.empty(b, n, n, dtype=torch.bool)


# ---- recording the specialisations through Triton's JIT ----------------------------------------


class StandInDriver:
    """The part of Triton's active driver that the JIT's binding and compiling read: a GPU target.
    Its device number is the compute capability, so each target gets its own JIT caches. Nothing
    is launched: the cache hook of `record_variants` stops every launch first."""

    def __init__(self, target: object) -> None:
        self.target = target

    def get_current_target(self) -> object:
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def record_variants(arch: int, launches: list[Launch]) -> tuple[dict[str, Variant], list[dict]]:
    """Run `launches` under a stand-in driver for sm_`arch`: each kernel specialisation once, and
    per launch the keys it used. Shape: -> ({key: Variant}, [{label, keys}] in launch order)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    variants: dict[str, Variant] = {}
    used: list[str] = []

    def hook(*, key: str, fn: object, compile: dict, **_: object) -> bool:  # noqa: A002 (Triton's names)
        spec = json.loads(compile["specialization_data"])
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
        name = f"{fn.name}|{key}"
        if name not in variants:
            args = (fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0], options)
            variants[name] = Variant(fn.name, name, args)
        used.append(name)
        return True  # do not compile here, do not launch

    per_launch = []
    previous_hook = knobs.runtime.jit_cache_hook
    driver.set_active(StandInDriver(GPUTarget("cuda", arch, 32)))  # left active: this process never launches
    knobs.runtime.jit_cache_hook = hook
    try:
        for launch in launches:
            used.clear()
            launch.run()
            for name in dict.fromkeys(used):
                variants[name].labels.append(launch.label)
                variants[name].strict |= launch.strict
            per_launch.append({"label": launch.label, "keys": sorted(set(used))})
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
    return variants, per_launch


# ---- compiling and judging ----------------------------------------------------------------------


def compile_variant(variant: Variant, arch: int) -> dict:
    """Compile one specialisation for sm_`arch`; its shared memory, registers and spills, and the
    faults found. Shape: -> {kernel, key, arch, ..., faults: [str]}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constexprs, attrs, options = variant.compile_args
    row = {"kernel": variant.kernel, "key": variant.key, "arch": arch, "launches": variant.labels,
           "strict": variant.strict, "faults": []}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
    except Exception as e:  # noqa: BLE001 (any compiler failure is the finding)
        row["faults"].append(f"compile error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return row
    row["compile_s"] = round(time.perf_counter() - start, 2)
    row["num_warps"] = compiled.metadata.num_warps
    row["shared"] = compiled.metadata.shared
    row.update(resource_usage(compiled.asm["cubin"]))
    if row["shared"] > SHARED_LIMIT[arch]:
        row["faults"].append(f"shared memory {row['shared']} B > sm_{arch}'s {SHARED_LIMIT[arch]} B")
    roundings = len(BF16_OPS.findall(compiled.asm["ptx"]))
    if 0 < roundings < ROUNDS_AS_EAGER.get(variant.kernel, 0):
        row["faults"].append(f"{roundings} bfloat16 roundings where the eager ops make "
                             f"{ROUNDS_AS_EAGER[variant.kernel]} (a fused multiply-add)")
    if row["spill"] and variant.strict:
        row["faults"].append(f"{row['spill']} B of register spills in a bfloat16 decode / verify launch")
    return row


def resource_usage(cubin: bytes) -> dict:
    """Registers and spilled bytes (the stack frame) of a one-kernel cubin, read by cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(_cuobjdump()), "--dump-resource-usage", str(path)], check=True,
                             capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return {"registers": int(found[1]), "spill": int(found[2])}


def run_check(archs: list[int], select: str = "", keys_only: bool = False, jobs: int = 1) -> dict:
    """Record and (unless keys_only) compile every launch of the plan whose label contains
    `select`. Shape: -> {arch: {launches: [...], variants: [...]}, failures: [str]}."""
    os.environ["SPECSERVE_FORCE_TRITON"] = "1"  # the launchers take CPU tensors to the kernel
    launches = [launch for launch in launch_plan() if select in launch.label]
    report: dict = {"triton": triton.__version__, "failures": []}
    for arch in archs:
        variants, per_launch = record_variants(arch, launches)
        if keys_only:
            rows = [{"kernel": v.kernel, "key": v.key, "launches": v.labels, "strict": v.strict}
                    for v in variants.values()]
        else:  # threads: the compiler's passes and ptxas run outside the GIL
            with ThreadPoolExecutor(jobs) as pool:
                rows = list(pool.map(compile_variant, variants.values(), [arch] * len(variants)))
        report[str(arch)] = {"launches": per_launch, "variants": rows}
        for row in rows:
            report["failures"] += [f"sm_{arch} {row['kernel']} ({row['launches'][0]}): {f}"
                                   for f in row.get("faults", [])]
    return report


def summary_lines(report: dict) -> Iterator[str]:
    """One line per compiled variant that spills or fails, then the failures."""
    for arch in (k for k in report if k.isdigit()):
        rows = report[arch]["variants"]
        yield f"sm_{arch}: {len(report[arch]['launches'])} launches, {len(rows)} kernel specialisations"
        for row in rows:
            if row.get("spill") or row.get("faults"):
                yield (f"  {row['kernel']} shared={row.get('shared')} regs={row.get('registers')} "
                       f"spill={row.get('spill')} B, first launch: {row['launches'][0]}")
    for failure in report["failures"]:
        yield f"FAIL {failure}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve_kernels.compile_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="90,80", help="compute capabilities, comma-separated (90 = H100, 80 = A100)")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--select", default="", help="only the launches whose label contains this text")
    parser.add_argument("--keys-only", action="store_true", help="record the specialisations, compile nothing")
    parser.add_argument("--inject", choices=sorted(FAULTS), help="put a known fault back, to see the check fail")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at a time (default: the cores)")
    args = parser.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    if not set(archs) <= SHARED_LIMIT.keys():
        parser.error(f"--arch: one of {sorted(SHARED_LIMIT)}, comma-separated")
    reason = missing_support()
    if os.environ.get("TRITON_INTERPRET") == "1":
        reason = "TRITON_INTERPRET=1 is set: the check needs Triton's compiler, not its interpreter"
    if reason is not None:
        print(f"compile check unavailable: {reason}", file=sys.stderr)
        return 2
    if args.inject:
        inject(args.inject)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # fused multiply-add, as triton <= 3.9 defaults
    report = run_check(archs, args.select, args.keys_only, args.jobs)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    for line in summary_lines(report):
        print(line)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
