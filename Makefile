# See README.md. Every target is a thin wrapper; the logic lives in build.sh
# and scripts/.
VENV ?= .venv
export VENV

.PHONY: build-wheel apply patches test test-gpu bench clean

## build-wheel: dist/vllm-<release>+dsa.sm120.<series>-*.whl (BUILD_MODE=precompiled|source)
build-wheel:
	./build.sh

## apply: (re)create vllm-src/ = pinned release + patches/series, one commit per patch
apply:
	python3 scripts/series.py apply

## patches: export vllm-src/'s commits back to patches/ (a no-op when nothing changed)
patches:
	python3 scripts/series.py export

## test: build and install the wheel into $(VENV), run the CPU test suite
test:
	scripts/run-tests.sh

## test-gpu: the tests that need a CUDA GPU (run on a GPU machine)
test-gpu:
	PYTEST_MARK=gpu scripts/run-tests.sh

clean:
	rm -rf build dist vllm-src.new
