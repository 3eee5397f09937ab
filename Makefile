# See README.md. Every target is a thin wrapper; the logic lives in build.sh
# and scripts/.
VENV ?= .venv
export VENV
# Every target runs under supervise.py: Ctrl-C or a SIGTERM to make stops all
# that the target started, and make returns once all of it has exited.
SUPERVISE = python3 scripts/supervise.py

.PHONY: build-wheel apply patches rebase compat lint test test-gpu wheelhouse e2e-models bench bench-engine soak clean

## build-wheel: dist/vllm-<release>+dsa.sm120.<series>-*.whl (BUILD_MODE=precompiled|source)
build-wheel:
	$(SUPERVISE) ./build.sh

## apply: (re)create vllm-src/ = pinned release + patches/series, one commit per patch
apply:
	$(SUPERVISE) python3 scripts/series.py apply

## patches: export vllm-src/'s commits back to patches/ (a no-op when nothing changed)
patches:
	$(SUPERVISE) python3 scripts/series.py export

## rebase: carry the series to VLLM_VERSION=<release|newest> (or VLLM_SRC=<checkout> VLLM_REF=<commit>)
## in vllm-rebase/ and print each patch's fate; WRITE=1 rewrites patches/ + vllm-pin.txt on success
rebase:
	$(SUPERVISE) python3 scripts/series.py rebase

## compat: regenerate docs/compatibility.md (the series on several vLLM releases)
compat:
	$(SUPERVISE) python3 scripts/series.py compat

## lint: ruff check (pyproject.toml) with $(VENV)'s ruff (tests/requirements.txt); then, where
## vllm-src/ exists, vLLM's own ruff rules (check and format) on the files the series changes
lint:
	$(SUPERVISE) $(VENV)/bin/python -m ruff check .
	if [ -d vllm-src/.git ]; then $(SUPERVISE) $(VENV)/bin/python scripts/series.py lint; fi

## test: build and install the wheel into $(VENV), lint, run the CPU test suite
test:
	$(SUPERVISE) scripts/run-tests.sh

## test-gpu: the tests that need a CUDA GPU, the end-to-end engine tests among them (on a GPU
## machine, fails without one; WHEELHOUSE=<dir> installs from `make wheelhouse` output without a package index;
## PYTEST_ARGS="-n 4 --dist loadfile" runs the test files side by side with pytest-xdist)
test-gpu:
	PYTEST_MARK=gpu $(SUPERVISE) scripts/run-tests.sh $(PYTEST_ARGS)

## wheelhouse: every runtime wheel for a GPU machine without a package index (WHEELHOUSE=<dir>,
## WHEELHOUSE_PYTHON=3.12, WHEELHOUSE_PLATFORM=x86_64; WHEELHOUSE_SKIP="torch nvidia-* ...": what the
## target Python has, left out and listed in SKIPPED.txt)
wheelhouse:
	$(SUPERVISE) scripts/wheelhouse.sh

## e2e-models: the end-to-end tests' tiny GLM-5 / GLM-5.2 / DeepSeek-V3.2 checkpoints and GGUF
## files (llama.cpp's converter and quantizer) in E2E_MODELS (default build/e2e)
# PYTHONPATH: the folders it imports from besides its own, as pytest's pythonpath
# (pyproject.toml) has them
e2e-models:
	$(SUPERVISE) env PYTHONPATH=scripts:tests$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(VENV)/bin/python tests/e2e/models.py build $${E2E_MODELS:-build/e2e}

## bench: GPU kernel benchmarks vs FlashMLA sparse / DeepGEMM, ggml's GGUF kernels vs dequantize + float kernels (same run) -> bench/results/
bench:
	$(SUPERVISE) scripts/run-bench.sh

## bench-engine: `vllm serve` under `vllm bench serve` on real-width GGUF files (GPU): the series'
## path vs upstream's vs llama.cpp, same run -> bench/results/<card>/engine.{jsonl,md};
## BENCH_ENGINE_ARGS="--quick" (~11 min: each vLLM server takes ~3 min to start), "--stage prepare|run", "-- --files glm5-tp8:q8_0"
bench-engine:
	$(SUPERVISE) scripts/run-bench-engine.sh $${BENCH_ENGINE_ARGS:-}

## soak: `vllm serve` under load and abuse for minutes (GPU): SOAK_GGUF / SOAK_HF (default the
## end-to-end GLM-5 Q4_K_M), SOAK_OUT (default build/soak), SOAK_ARGS (soak.py's own arguments,
## then `-- <vllm serve arguments>`, e.g. "--minutes 10 -- --tensor-parallel-size 2")
soak:
	$(SUPERVISE) $(VENV)/bin/python scripts/soak.py \
	  --gguf $${SOAK_GGUF:-build/e2e/glm5/glm5-q4_k_m.gguf} --hf $${SOAK_HF:-build/e2e/glm5/hf} \
	  --out $${SOAK_OUT:-build/soak} $${SOAK_ARGS:-}

clean:
	rm -rf build dist vllm-src.new
