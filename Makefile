# Two entry points, each working on a fresh machine (they create .venv on first use):
#   make demo   - the main job: long-context KV recall, 2 CPU processes, sequence parallel (sp=2)
#   make test   - the test suite
#   make benchmarks - every benchmark, then BENCHMARKS.md (about 15 minutes on 2 cores)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13 CPU build; on a GPU machine install your CUDA build of torch first and set TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test install benchmarks
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,plot]"
	touch $@

demo: install
	$(VENV)/bin/lightning-autosp fit --config configs/demo_cpu.yaml

test: install
	$(PY) -m pytest -q -p no:cacheprovider

benchmarks: install
	DS_BUILD_OPS=0 $(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(PY) benchmarks/report.py
