# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GGUF linear layers for the kernel tests, built the way vLLM's GGUF
loader builds and fills them (tests only: the methods are vLLM's own)."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType


def gguf_layer(shards: list[tuple[str, torch.Tensor]], *, device: str = "cpu",
               dtype: torch.dtype = torch.float16, cls: type = torch.nn.Module,
               embedding: bool = False) -> torch.nn.Module:
    """A layer of ``cls`` on GGUFLinearMethod (GGUFEmbeddingMethod where
    ``embedding``, as an lm_head or a token embedding has) holding shards
    [(type name, raw [rows, bytes]; F16: the values)], filled as the loader
    fills it (a fused layer's shards in llama.cpp's order, the last first),
    processed after loading; ``quant_method`` set."""
    from vllm.model_executor.layers.quantization.gguf import (
        GGUFConfig,
        GGUFEmbeddingMethod,
        GGUFLinearMethod,
    )

    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    method = (GGUFEmbeddingMethod if embedding else GGUFLinearMethod)(GGUFConfig())
    rows = [raw.shape[0] for _, raw in shards]
    qtype, raw = shards[0]
    cols = raw.shape[1]
    if raw.dtype == torch.uint8:  # GGUF blocks
        block, size = GGML_QUANT_SIZES[QType[qtype]]
        cols = cols // size * block
    with torch.device(device):
        method.create_weights(layer, cols, rows, cols, sum(rows), dtype)
        if len(shards) == 1:
            layer.qweight.materialize(raw.shape, dtype=raw.dtype)
            layer.qweight.data.copy_(raw)
            layer.qweight_type.weight_type = int(QType[qtype])
        else:
            for shard in reversed(range(len(shards))):
                qtype, raw = shards[shard]
                layer.qweight.shard_id.append(shard)
                layer.qweight.shard_id_map[shard] = len(layer.qweight.data_container)
                layer.qweight.data_container.append(raw.to(device))
                layer.qweight_type.shard_weight_type[shard] = int(QType[qtype])
        method.process_weights_after_loading(layer)
    layer.quant_method = method
    return layer
