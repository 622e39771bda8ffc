"""Triton kernels for tree speculative decoding, each with a plain-PyTorch reference.

Every launcher checks its inputs, runs the Triton kernel on CUDA tensors and the reference on CPU
tensors (`verify_greedy`: the same walk over host lists, `greedy_walk`; `SPECSERVE_FORCE_TRITON=1`
forces the kernel, for testing under `TRITON_INTERPRET=1`).

    build_tree      parents -> depth, ancestor mask, first_child / next_sibling links
    verify_greedy   accept the draft path matching the target's argmax, plus a bonus token
    verify_sample   lossless tree speculative sampling (target-only), plus a bonus token
    compact_kv      move the accepted nodes' K/V to consecutive positions, in place
    tree_attention  decode / tree-verify attention over the slot KV cache's live keys
    add_rms_norm, rope_kv_write, silu_mul   a Llama layer's small ops fused for the GPU step
"""

from specserve_kernels._launch import MAX_NODES
from specserve_kernels.fused_layer import (
    add_rms_norm,
    add_rms_norm_reference,
    rope_kv_write,
    rope_kv_write_reference,
    silu_mul,
    silu_mul_reference,
)
from specserve_kernels.kv_compact import compact_kv, compact_kv_reference
from specserve_kernels.tree_attention import tree_attention, tree_attention_reference
from specserve_kernels.tree_build import TreeTensors, build_tree, build_tree_reference
from specserve_kernels.verify_greedy import VerifyResult, greedy_walk, verify_greedy, verify_greedy_reference
from specserve_kernels.verify_sample import verify_sample, verify_sample_reference

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "rope_kv_write",
    "rope_kv_write_reference",
    "silu_mul",
    "silu_mul_reference",
    "MAX_NODES",
    "TreeTensors",
    "VerifyResult",
    "build_tree",
    "build_tree_reference",
    "compact_kv",
    "compact_kv_reference",
    "greedy_walk",
    "tree_attention",
    "tree_attention_reference",
    "verify_greedy",
    "verify_greedy_reference",
    "verify_sample",
    "verify_sample_reference",
]
