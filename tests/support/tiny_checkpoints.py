"""Tiny DSA checkpoints (GLM-5, GLM-5.2, DeepSeek-V3.x) written with
transformers: small random ones for the CPU GGUF tests (tests/gguf/
conftest.py) and the end-to-end test models (tests/e2e/models.py), which
bring their own geometry, seeds and weights.

transformers does not model GLM-5's NextN (MTP) block, an ordinary decoder
layer plus the NextN projections: a model with MTP layers is built with that
many more decoder layers, and its NextN tensors are added to the
safetensors, as GLM-5 checkpoints store them; config.json then names the
main layers and num_nextn_predict_layers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# The NextN block's own tensors besides eh_proj, in a layer's namespace.
NEXTN_NORMS = ("enorm", "hnorm", "shared_head.norm")


def write_checkpoint(
    path: Path,
    config_class: str,
    architecture: str,
    geometry: dict,
    layers: int,
    mtp_layers: int = 0,
    seed: int = 0,
    *,
    condition: Callable | None = None,
    nextn_tensors: Callable[[int], dict] | None = None,
    edit_state: Callable[[dict], None] | None = None,
    own_config: bool = True,
) -> None:
    """A checkpoint in path: transformers' `config_class` with `geometry`
    (its keys but the layer counts), initialised from torch.manual_seed(seed).

    condition(model): sets the weights before they are saved.
    nextn_tensors(hidden_size): one MTP layer's NextN tensors (names within
    the layer), called once per MTP layer, in order.
    edit_state(state): changes the saved tensors (by name) in place.
    own_config=False keeps the config transformers saved with the model
    (no MTP layers; DeepSeek-V3's own default of one NextN layer stays).
    """
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config_cls = getattr(transformers, config_class)
    total = layers + mtp_layers
    built = dict(geometry)
    if "indexer_types" in geometry:
        # the MTP block runs an indexer of its own
        built["indexer_types"] = (geometry["indexer_types"] + ["full"] * mtp_layers)[:total]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(num_hidden_layers=total, **built))
    if condition is not None:
        condition(model)
    model.save_pretrained(path)
    if own_config:
        saved = dict(geometry)
        if "indexer_types" in saved:
            saved["indexer_types"] = saved["indexer_types"][:layers]
        config = config_cls(num_hidden_layers=layers, num_nextn_predict_layers=mtp_layers,
                            **saved)
        config.architectures = [architecture]
        config.save_pretrained(path)
    if not (mtp_layers or edit_state):
        return
    state = load_file(path / "model.safetensors")
    for layer in range(layers, total):
        for name, tensor in nextn_tensors(geometry["hidden_size"]).items():
            state[f"model.layers.{layer}.{name}"] = tensor
    if edit_state is not None:
        edit_state(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
