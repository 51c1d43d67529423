# The two commands of the README: `make demo` runs the tool, `make test` runs the whole suite.
# Both set up everything from nothing (a venv, CPU torch, the native build) and are idempotent.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# torch==2.13.0: on the machines we develop on, pip's configured index serves the CPU build from
# a local wheel directory; elsewhere set PIP_INDEX_URL=https://download.pytorch.org/whl/cpu, or
# PyPI resolves the multi-GB CUDA build. transformers, peft, safetensors and accelerate are test
# dependencies only (tests/test_zoo.py builds tiny models from their config classes; the package
# never imports them), and so is simde-py (SIMDe's headers: tests/test_emulated_avx512.py runs
# the AVX-512 kernel on hosts without AVX-512) and mypy (tests/test_types.py), pinned to the versions the zoo was written against; installed in the same
# pip command as torch==2.13.0, so none of them can bring another torch.
DEPS := torch==2.13.0 numpy psutil aiofiles pytest tqdm setuptools wheel \
	transformers==5.24.0 peft==0.21.2 safetensors==0.8.0 accelerate==1.15.0 simde-py==0.8.2.post1 \
	mypy==2.4.1

.PHONY: demo test test-fast native setup clean

$(VENV)/.deps-stamp: Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q $(DEPS)
	touch $@

$(VENV)/.install-stamp: $(VENV)/.deps-stamp setup.py pyproject.toml $(wildcard native/*.cpp native/*.h)
	flock .build.lock $(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

setup: $(VENV)/.install-stamp

native: $(VENV)/.deps-stamp
	flock .build.lock $(VPY) setup.py -q build_ext --inplace

# The main job: what loaded here, the ledger for the example 29.5M GPT, then real training of a
# smaller one (examples/train_gpt.py) at stage 3 with its state on the nvme tier (a temporary directory).
demo: setup
	$(VENV)/bin/zero-offload info
	$(VENV)/bin/zero-offload estimate --model examples/models.py:gpt_small --stage 3 \
		--params-tier nvme --grads-tier cpu --optimizer-tier nvme
	$(VPY) examples/train_gpt.py

test: setup
	$(VPY) -m pytest tests

# The inner loop: the tests that start no ranks, need no transformers and are not slow
# (tests/conftest.py marks them); `make test` is the whole suite, and CI runs it.
test-fast: setup
	$(VPY) -m pytest tests -q -m "not dist and not hf and not slow"

clean:
	rm -rf build $(VENV) zero_offload/*.so *.egg-info
