# Lightning + Hydra distributed-training template. `make help` lists the targets.
PYTHON ?= python
DEVICES ?= 2
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | wc -l)
NNODES ?= 2
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
ARGS ?=
STAMP := .make/installed

.DEFAULT_GOAL := help
.PHONY: help install train train-ddp train-ddp-spawn train-dp train-pipeline train-torchrun test test-fast test-slow \
        lint format clean synthetic-cifar10 gpu-check train-gpu-ddp train-multinode bench bench-full \
        clean-logs pre-commit

help: ## Show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	@mkdir -p $(dir $@) && touch $@

install: $(STAMP) ## Install Python packages and the offline Fashion-MNIST data (idempotent)

train: $(STAMP) ## Train the default model (Fashion-MNIST MLP) on one device; extra overrides via ARGS="..."
	$(PYTHON) src/train.py $(ARGS)

train-ddp: $(STAMP) ## DDP with DEVICES processes (gloo on CPU, nccl on GPU)
	$(PYTHON) src/train.py trainer=ddp trainer.devices=$(DEVICES) $(ARGS)

train-ddp-spawn: $(STAMP) ## DDP started with torch.multiprocessing.spawn
	$(PYTHON) src/train.py trainer=ddp_spawn trainer.devices=$(DEVICES) $(ARGS)

train-dp: $(STAMP) ## DataParallel: one process, each batch split over DEVICES devices
	$(PYTHON) src/train.py trainer=dp trainer.devices=$(DEVICES) $(ARGS)

train-pipeline: $(STAMP) ## Pipeline parallel: the model split into DEVICES stages
	$(PYTHON) src/train.py trainer=pipeline trainer.devices=$(DEVICES) $(ARGS)

train-torchrun: $(STAMP) ## DDP under torchrun (one node, DEVICES processes)
	torchrun --standalone --nproc_per_node=$(DEVICES) src/train.py trainer=ddp trainer.devices=$(DEVICES) $(ARGS)

test: $(STAMP) ## Run the whole test suite (multi-process tests included; about 10-15 min on 2 cores)
	$(PYTHON) -m pytest -q

test-fast: $(STAMP) ## Run the quick subset (pytest -m fast)
	$(PYTHON) -m pytest -q -m fast

test-slow: $(STAMP) ## Run only the multi-process / multi-epoch tests
	$(PYTHON) -m pytest -q -m slow

lint: $(STAMP) ## Check style with ruff
	$(PYTHON) -m ruff check .

format: $(STAMP) ## Fix import order and simple style issues with ruff
	$(PYTHON) -m ruff check --fix .

pre-commit: $(STAMP) ## Install the git hooks (.pre-commit-config.yaml: ruff, then the fast tests) and run them once
	$(PYTHON) -m pre_commit install
	$(PYTHON) -m pre_commit run --all-files

bench: $(STAMP) ## Benchmarks, quick (a few min): project vs plain PyTorch -> bench_results/<time>/ (ARGS="--suite throughput")
	$(PYTHON) -m scripts.bench $(ARGS)

bench-full: $(STAMP) ## Benchmarks, full settings: whole epochs, 3 rounds, 10-epoch accuracy (about 15-20 min)
	$(PYTHON) -m scripts.bench --full $(ARGS)

synthetic-cifar10: $(STAMP) ## Write SYNTHETIC CIFAR-10 files (real format) to data/synthetic_cifar10
	$(PYTHON) scripts/make_synthetic_cifar10.py --out data/synthetic_cifar10

# --- GPU machines (e.g. an EC2 g5.12xlarge / p3.8xlarge with the NVIDIA driver installed) ---
gpu-check: ## Show GPUs, their interconnect and what torch sees
	nvidia-smi
	nvidia-smi topo -m
	$(PYTHON) -c "import torch; print('cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count(), 'nccl', torch.distributed.is_nccl_available())"

train-gpu-ddp: $(STAMP) ## DDP over all GPUS of this machine with nccl
	$(PYTHON) src/train.py trainer=ddp trainer.accelerator=gpu trainer.devices=$(GPUS) $(ARGS)

train-multinode: $(STAMP) ## One node of a multi-node DDP run: set NNODES, NODE_RANK, MASTER_ADDR (node 0's IP), MASTER_PORT
	MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT) NODE_RANK=$(NODE_RANK) \
	$(PYTHON) src/train.py trainer=ddp trainer.num_nodes=$(NNODES) trainer.devices=$(if $(filter 0,$(GPUS)),1,$(GPUS)) $(ARGS)

clean-logs: ## Remove logs/: every run's checkpoints, metrics, configs and MLflow store
	rm -rf logs/

clean: ## Remove caches and the install stamp (keeps data/ and logs/)
	rm -rf .make .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
