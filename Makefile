# Kernel Fusion with Triton: the front door.
#   make lab      open the notebooks in JupyterLab (sets everything up the first time)
#   make test     the whole suite on the CPU (Triton's interpreter), as CI runs it, then the CPU unit
#                 tests and the compile matrix again under the newest Triton pip installs
#   make grade    grade every exercise notebook (NB=exercises/01_launch_overhead.ipynb for one)
# On a machine whose python3 already has torch, triton and the Jupyter stack (a GPU host),
# skip the virtual environment with PY=python3.

VENV ?= .venv
PY ?= $(VENV)/bin/python
ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
else
SETUP :=
endif
PORT ?= 8888
NB ?= exercises
JUNIT ?=
WORKERS ?= 2
BROWSER_NB ?=
GPU_WORKERS ?= 16
NB_WORKERS ?= 8
CPU_ENV := TRITON_INTERPRET=1 COURSE_MODE=interpreter
GPU_ENV := COURSE_MODE=cuda

.PHONY: setup lab test test-unit test-notebooks test-gpu test-browser test-triton-next grade exercises \
        solutions check-exercises bench bench-recorded lint clean chromium compile-matrix

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tools/setup_env.sh
	VENV=$(VENV) bash tools/setup_env.sh

lab: $(SETUP)
	$(PY) -m jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --port=$(PORT) \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) notebooks/

# Tests are handed out one at a time (worksteal); a notebook's cells run in order in one kernel, so
# the notebooks go file by file (loadfile) in a second run. The browser test opens the lectures that
# show a course widget (make test-browser opens every lecture).
test: $(SETUP) lint check-exercises chromium
	$(CPU_ENV) COURSE_BROWSER_NB=widgets $(PY) -m pytest -n $(WORKERS) --dist worksteal tests
	$(CPU_ENV) $(PY) -m pytest -n $(WORKERS) --dist loadfile --nbval-lax --nbval-current-env notebooks
	$(MAKE) --no-print-directory test-triton-next

# The CPU unit tests (not slow) and the compile matrix under the NEWEST Triton release, in a second
# virtual environment (build/venv-triton-next: .venv's packages plus its own triton); see the script.
test-triton-next: $(SETUP)
	BASE_PY=$(PY) WORKERS=$(WORKERS) bash tools/triton_next.sh

test-unit: $(SETUP)
	$(CPU_ENV) $(PY) -m pytest -n $(WORKERS) --dist worksteal tests -m "not slow and not browser"

# On an H100 host (16 cores), cold Triton cache: see the README for the measured time. Three runs:
# the tests in parallel, the notebooks in parallel (file by file), then the few tests that hold
# 8-20 GiB of GPU memory (marked bigmem), one at a time with nothing else on the card. On a GPU the
# compile-only matrix for sm_75/80/90 is left to the CPU suite, and the longest tests start first
# (tests/conftest.py). The first run lists its slowest tests; the last line gives each run's seconds.
# On a card of NB_BESIDE_GIB or more (an H100, an H200) the notebooks run beside the tests phase, which
# leaves cores idle in its last minute, with 2 threads a kernel; on a smaller card after it, where 24
# processes could leave the bigmem tests (8-20 GiB each, one at a time, after the tests phase) too little.
NB_BESIDE_GIB ?= 64
test-gpu: $(SETUP)
	@rc=0; t0=$$(date +%s); \
	gib=$$($(PY) -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)" 2>/dev/null || echo 0); \
	nb="$(GPU_ENV) $(PY) -m pytest -n $(NB_WORKERS) --dist loadfile --nbval-lax --nbval-current-env notebooks $(PYTEST_ARGS)"; \
	if [ "$$gib" -ge $(NB_BESIDE_GIB) ]; then \
	  (export OMP_NUM_THREADS=2; eval "$$nb" > .notebooks.log 2>&1; echo $$? > .notebooks.rc; date +%s > .notebooks.end) & fi; \
	$(GPU_ENV) $(PY) -m pytest -n $(GPU_WORKERS) --dist worksteal tests -m "not browser and not bigmem" \
	  --durations=25 $(PYTEST_ARGS) || rc=1; \
	t1=$$(date +%s); \
	$(GPU_ENV) $(PY) -m pytest -p no:xdist tests -m bigmem $(PYTEST_ARGS) || rc=1; \
	t2=$$(date +%s); \
	if [ "$$gib" -ge $(NB_BESIDE_GIB) ]; then wait; cat .notebooks.log; [ "$$(cat .notebooks.rc)" = 0 ] || rc=1; \
	  nb_s="$$(( $$(cat .notebooks.end) - t0 )) s beside the tests"; rm -f .notebooks.log .notebooks.rc .notebooks.end; \
	else eval "$$nb" || rc=1; nb_s="$$(( $$(date +%s) - t2 )) s"; fi; \
	t3=$$(date +%s); \
	echo "make test-gpu: $$((t3 - t0)) s (tests $$((t1 - t0)) s, bigmem $$((t2 - t1)) s, notebooks $$nb_s)"; \
	exit $$rc

test-browser: $(SETUP) chromium
	$(CPU_ENV) COURSE_BROWSER_NB=$(BROWSER_NB) $(PY) -m pytest tests/test_browser.py -m browser -p no:xdist -s

# A Chromium for the browser test: the one that is there, else Debian's when this user may apt-get,
# else the browser test is skipped with the reason (a failure when CI=true).
chromium:
	@bash tools/install_chromium.sh >/dev/null

# The whole compile matrix, no GPU needed: every course kernel at every tile choice its launchers make,
# for sm_75 (T4), sm_80 (A100) and sm_90 (H100), under the pinned and the newest Triton (make test
# compiles each kernel's smallest and largest choice only). About 30 minutes on 2 cores: its own CI job.
compile-matrix: $(SETUP)
	$(PY) -m course_utils.aot
	BASE_PY=$(PY) WORKERS=$(WORKERS) AOT_ARGS= NEXT_ARCHS="75 80 90" RUN_TESTS=0 bash tools/triton_next.sh

grade: $(SETUP)
	$(PY) -m course_utils.grade $(if $(CLASS),--class $(CLASS),$(NB)) $(if $(JUNIT),--junit $(JUNIT)) \
	  $(if $(CSV),--csv $(CSV)) $(if $(JOBS),--jobs $(JOBS))

exercises: $(SETUP)
	$(PY) -m course_utils.exercises write

check-exercises: $(SETUP)
	$(PY) -m course_utils.exercises check

# Re-run the solutions (interpreter mode) and save only their check cells' outputs.
solutions: $(SETUP)
	$(CPU_ENV) $(PY) -m course_utils.exercises refresh-solutions

# Judge the speed targets from the recorded results (no GPU needed).
bench-recorded: $(SETUP)
	$(PY) -m benchmarks.run --recorded

bench: $(SETUP)
	$(GPU_ENV) $(PY) -m benchmarks.run $(BENCH_ARGS)

lint: $(SETUP)
	$(PY) -m ruff check course_utils tests benchmarks tools

clean:
	rm -rf $(VENV) build test-artifacts *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Chapter 13 on 2 and 4 GPUs of one host (one process per GPU under torchrun; skipped on fewer GPUs).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, set again inside every process).
test-gpu-multi: $(SETUP)
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 $(GPU_ENV) \
	  $(PY) -m pytest -p no:xdist tests/test_multigpu.py -v $(PYTEST_ARGS)
