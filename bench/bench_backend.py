#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Times TRITON_MLA_SPARSE's forward_mqa (slot conversion + q concat +
kernel) against the kernel alone on pre-converted slots, GLM-5 geometry
(topk 2048, d_qk 576, d_v 512), on a paged cache of 64-row blocks.

Decode batches are captured in a CUDA graph and timed by replay (as vLLM
runs them); prefill is timed eagerly. Prints a markdown table (needs a CUDA
GPU and the series' wheel installed).
"""

import argparse
import math
from types import SimpleNamespace

import torch
from triton.testing import do_bench
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.triton_mla_sparse import (
    TritonMLASparseImpl,
    TritonMLASparseMetadataBuilder,
)
from vllm.v1.attention.ops.triton_sparse_mla import sparse_mla_fwd
from vllm.v1.kv_cache_interface import MLAAttentionSpec

TOPK = 2048
BS = 64
D = 576
DV = 512


def setup(num_reqs, q_len, seq_len, heads, dtype):
    dev = torch.device("cuda")
    nb_req = math.ceil(seq_len / BS)
    num_blocks = num_reqs * nb_req
    cache = torch.randn(num_blocks, BS, D, device=dev).to(dtype)
    block_table = (
        torch.randperm(num_blocks, device=dev).to(torch.int32).view(num_reqs, nb_req)
    )
    T = num_reqs * q_len
    topk = torch.randint(0, seq_len, (T, TOPK), device=dev, dtype=torch.int32)
    q = torch.randn(T, heads, D, device=dev).to(dtype)
    qsl = torch.arange(0, T + 1, q_len, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32, device=dev),
        num_reqs=num_reqs,
        num_actual_tokens=T,
        max_query_len=q_len,
        max_seq_len=seq_len,
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(T, dtype=torch.int64, device=dev),
    )
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(index_topk=TOPK)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=T),
        speculative_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=D, dtype=dtype)
    md = TritonMLASparseMetadataBuilder(spec, ["l"], cfg, dev).build(0, cm)
    impl = TritonMLASparseImpl(
        num_heads=heads,
        head_size=D,
        scale=1.0 / math.sqrt(256),
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        kv_lora_rank=DV,
        indexer=SimpleNamespace(topk_indices_buffer=topk),
    )
    ql_nope = q[..., :DV].transpose(0, 1).contiguous().transpose(0, 1)
    q_pe = q[..., DV:]
    return impl, md, cache, q, ql_nope, q_pe


def main():
    torch.manual_seed(0)
    rows = []
    cases = []
    for heads in (8, 16, 64, 128):
        for b in (1, 8, 32, 128):
            cases.append(("decode", b, 1, 8192, heads, torch.float16))
    cases += [("decode", b, 1, 8192, 64, torch.bfloat16) for b in (1, 32)]
    for heads in (8, 64, 128):
        cases.append(("prefill", 1, 1024, 8192, heads, torch.float16))
    cases.append(("prefill", 1, 4096, 8192, 64, torch.float16))
    cases.append(("prefill", 1, 4096, 8192, 64, torch.bfloat16))
    for kind, b, q_len, seq, heads, dtype in cases:
        impl, md, cache, q, ql_nope, q_pe = setup(b, q_len, seq, heads, dtype)

        # Called and captured in this iteration only; the defaults bind its tensors.
        def backend(impl=impl, ql_nope=ql_nope, q_pe=q_pe, cache=cache, md=md):
            return impl.forward_mqa((ql_nope, q_pe), cache, md, None)[0]

        slots = impl._to_global_slots(impl.topk_indices_buffer, md)
        kv = cache.view(-1, 1, D)
        idx = slots.view(slots.shape[0], 1, -1)

        def kernel(q=q, kv=kv, idx=idx, impl=impl):
            return sparse_mla_fwd(q, kv, idx, impl.softmax_scale, DV)[0]

        torch.testing.assert_close(backend(), kernel(), rtol=0, atol=0)
        if kind == "decode":
            fns = []
            for fn in (backend, kernel):
                fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                fns.append(g.replay)
        else:
            fns = [backend, kernel]
        t_b, t_k = (do_bench(f, warmup=25, rep=100, return_mode="median") for f in fns)
        T = b * q_len
        gbytes = T * TOPK * D * cache.element_size() / 1e9
        rows.append(
            f"| {kind} | {b} | {q_len} | {heads} | {str(dtype)[6:]} | "
            f"{t_b * 1e3:.1f} | {t_k * 1e3:.1f} | {(t_b - t_k) * 1e3:.1f} | "
            f"{gbytes / (t_k * 1e-3) / 1e3:.2f} |"
        )
        print(rows[-1], flush=True)
    print()
    print(
        "| path | reqs | q_len | h_q | dtype | forward_mqa µs | kernel µs "
        "| overhead µs | kernel gathered TB/s |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    main()
