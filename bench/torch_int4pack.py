"""torch's own int4 CPU matmul (`_weight_int4pack_mm_for_cpu`, what torchao's int4 weight-only CPU layout
calls) on SmolLM2-135M's 121 weight shapes, every one in int4 with a scale and zero per group of 32, at bf16
and float32 activations: the library the GGUF kernel (`bench/cpu_linear.py --gguf`) was measured against.

    .venv/bin/python bench/torch_int4pack.py
"""

from __future__ import annotations

import time

import torch

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152


def main() -> None:
    torch.set_num_threads(2)
    qkv = HIDDEN + 2 * (HIDDEN // 3)
    shapes = [(qkv, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    shapes.append((VOCAB, HIDDEN))
    mats = []
    for n, k in shapes:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        mats.append((packed, torch.rand(k // 32, n, 2, dtype=torch.bfloat16), k))
    print(f"torch {torch.__version__}; packed {sum(p.nbytes for p, _, _ in mats) / 1e6:.1f} MB")
    for dtype in (torch.bfloat16, torch.float32):
        scales = [s.to(dtype) for _, s, _ in mats]
        for rows in (1, 2, 4, 8):
            x = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, INTERMEDIATE)}

            def run(x: dict = x, scales: list = scales) -> None:
                for (packed, _, k), s in zip(mats, scales):
                    torch._weight_int4pack_mm_for_cpu(x[k], packed, 32, s)

            run()
            best = float("inf")
            for _ in range(7):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            print(f"{dtype} activations, rows {rows}: {best * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
