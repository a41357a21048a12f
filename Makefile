# Two entry points, each working on a fresh machine (they create .venv on first use):
#   make demo   - the main job: long-context KV recall, 2 CPU processes, sequence parallel (sp=2)
#   make test   - the test suite's default tier: every unit test, one fit per feature (within 10 minutes on 2 cores)
#   make test-all - every test (CI runs it: .ci/run)
#   make benchmarks - the benchmarks behind BENCHMARKS.md, then the page (about 1 hour 50 minutes on 2 cores;
#                     benchmarks/sac_memory.py runs on its own)
#   make test-compat TORCH_SPEC=torch==2.9.1 [LIGHTNING_SPEC=lightning==2.5.0]
#                   - the compatibility subset against another torch / Lightning, in its own
#                     venv (COMPAT_VENV, default .venv-compat-<specs>); .venv is left alone
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13 CPU build; on a GPU machine install your CUDA build of torch first and set TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

# the compatibility subset: version gates, the pass, SAC, GPT and Llama numerics with SAC on and
# off, the Hugging Face decoders, the CLI, the sharded mode and its checkpoints, LitGPT and the
# Fabric strategy, whole-block recompute, the tiled regions, the core without Lightning, the ring level,
# gradient checkpointing and LoRA (docs/testing.md lists where it passed)
LIGHTNING_SPEC ?=
COMPAT_VENV ?= .venv-compat-$(shell echo '$(TORCH_SPEC)$(if $(LIGHTNING_SPEC),-$(LIGHTNING_SPEC))' | tr -c 'A-Za-z0-9.\n-' '_')
COMPAT_TESTS := tests/test_compat.py tests/test_strategy.py tests/test_pass.py tests/test_sac.py \
	'tests/test_numerics.py::test_matches_single_device[gpt-sp2-ignore]' \
	'tests/test_numerics.py::test_matches_single_device[llama-sp2-2layers-accumulate-validate]' \
	'tests/test_numerics.py::test_matches_single_device[llama-dp2xsp2]' \
	'tests/test_numerics.py::test_matches_single_device[llama-sp2-nosac]' \
	'tests/test_numerics.py::test_negative_control_sharding_without_pass_fails[llama]' \
	tests/test_any_model.py::test_hugging_face_decoders tests/test_errors.py \
	tests/test_memory_monitor.py::test_autosp_with_sac tests/test_cli.py tests/test_fsdp.py tests/test_checkpoints.py \
	tests/test_failures.py::test_fork_launch_in_a_notebook tests/test_failures.py::test_forkserver_launch_gives_each_rank_its_own_parameters \
	'tests/test_litgpt.py::test_litgpt_matches_one_device[llama-pretrain-2]' tests/test_fabric.py tests/test_moe.py \
	tests/test_offload.py::test_block_recompute_is_exact tests/test_tiled_mlp.py::test_regions_are_the_mlps_with_their_norms \
	tests/test_tiled_mlp.py::test_bf16_norms_are_tiled_too tests/test_plain_torch.py \
	tests/test_ring_attention.py 'tests/test_ring.py::test_ring_layouts_match_one_device[llama-gqa-ulysses2xring2-31]' \
	'tests/test_ring.py::test_ring_layouts_match_one_device[auto-3heads-sp2]' tests/test_ring.py::test_default_configuration_on_a_ring \
	'tests/test_checkpointing.py::test_hugging_face_gradient_checkpointing_matches_one_device[sp2]' \
	tests/test_checkpointing.py::test_checkpointing_written_by_hand_matches_one_device \
	tests/test_checkpointing.py::test_hugging_face_checkpointing_is_refused_where_dynamo_cannot_trace_it 'tests/test_lora.py::test_lora_matches_one_device[sharded]'

.PHONY: demo test test-all install benchmarks test-compat
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,plot]"
	# LitGPT for tests/test_litgpt.py, without its dependencies: it pins an older jsonargparse
	# than ours and imports fine with what we install (psutil is the one it lacks)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "litgpt==0.5.13" "psutil>=5"
	touch $@

demo: install
	$(VENV)/bin/lightning-autosp fit --config configs/demo_cpu.yaml

test: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

test-all: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 --all

benchmarks: install
	DS_BUILD_OPS=0 $(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(PY) benchmarks/report.py

# pip refuses a TORCH_SPEC / LIGHTNING_SPEC outside pyproject.toml's ranges
test-compat:
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" $(if $(LIGHTNING_SPEC),"$(LIGHTNING_SPEC)") -e ".[test]"
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps "litgpt==0.5.13" "psutil>=5"
	$(COMPAT_VENV)/bin/python -c "import torch, lightning; print('torch', torch.__version__, '/ lightning', lightning.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider --all $(COMPAT_TESTS)
