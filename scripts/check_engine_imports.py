"""Import what a vLLM engine and `vllm serve` import when they start, and say
which module is missing. `make test-gpu` runs it after the install: with
WHEELHOUSE_NO_DEPS=1 a wheelhouse goes into a Python that is meant to hold
the rest, and a requirement missing there otherwise shows only as every
engine failing at start, minutes later.

    python scripts/check_engine_imports.py
"""

from __future__ import annotations

import importlib
import sys

# Modules whose import pulls in what an engine start needs (the request type
# imports the structured-output backends), the OpenAI server, and the series'
# own modules; then the quantization configs, which load at engine start.
MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.entrypoints.openai.api_server",
    "vllm.model_executor.model_loader.gguf_dsa",
    "vllm.model_executor.layers.quantization.gguf_split_moe",
    "vllm.v1.attention.ops.dsa_indexer_k_cache",
)
# The sampler's CUDA path imports FlashInfer while the engine starts, before
# it asks whether the card can use it, unless VLLM_USE_FLASHINFER_SAMPLER=0
# (vllm/v1/sample/ops/topk_topp_sampler.py).
SAMPLER_MODULE = "vllm.v1.attention.backends.flashinfer"


def check() -> list[str]:
    """One line per failure: the module asked for and the error."""
    from vllm import envs

    wanted = [(name, "") for name in MODULES]
    if envs.VLLM_USE_FLASHINFER_SAMPLER:
        wanted.append((SAMPLER_MODULE,
                       " (the sampler; VLLM_USE_FLASHINFER_SAMPLER=0 leaves it out)"))
    failures = []
    for name, why in wanted:
        try:
            importlib.import_module(name)
        except Exception as e:  # an ImportError, or whatever a module raises at import
            failures.append(f"{name}{why}: {type(e).__name__}: {e}")
    if not failures:
        from vllm.model_executor.layers import quantization

        # It imports every method's config module, whichever method is asked for.
        try:
            quantization.get_quantization_config("gguf")
        except Exception as e:
            failures.append(f"quantization configs: {type(e).__name__}: {e}")
    return failures


def main() -> int:
    failures = check()
    for line in failures:
        print(f"error: {line}", file=sys.stderr)
    if failures:
        print("error: the installed vLLM cannot start an engine; install the missing "
              "packages (`make wheelhouse` holds every requirement)", file=sys.stderr)
        return 1
    print(f"engine imports: {len(MODULES)} modules and the quantization configs load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
