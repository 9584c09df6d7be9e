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
.PHONY: help install train train-ddp train-ddp-spawn train-dp train-pipeline train-torchrun test test-fast test-oldest test-slow \
        lint format clean synthetic-cifar10 gpu-check gpu-verify train-gpu-ddp train-multinode bench bench-full \
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

test: $(STAMP) ## Run the whole test suite: two test files at a time (pytest-xdist), then the timed ones alone
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not serial"
	$(PYTHON) -m pytest -q -m serial

test-fast: $(STAMP) ## Run the quick subset (pytest -m fast)
	$(PYTHON) -m pytest -q -m fast

# The oldest Lightning pyproject.toml allows, in .venv-oldest: the packages $(PYTHON) has (a venv's too, which
# --system-site-packages would not see), with Lightning replaced
SITE_PACKAGES = import sysconfig; print(sysconfig.get_paths()['purelib'])
LIGHTNING_FLOOR = $(shell $(PYTHON) -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print(next(re.search(r'>=([^,]+)', d).group(1) for d in deps if d.startswith('lightning')))")

test-oldest: $(STAMP) ## Run the quick subset on the oldest Lightning pyproject.toml allows (.venv-oldest)
	[ -x .venv-oldest/bin/python ] || { $(PYTHON) -m venv .venv-oldest && \
	  echo "import site; site.addsitedir('$$($(PYTHON) -c "$(SITE_PACKAGES)")')" \
	    > "$$(.venv-oldest/bin/python -c "$(SITE_PACKAGES)")/installed_packages.pth"; }
	.venv-oldest/bin/pip install --quiet "lightning==$(LIGHTNING_FLOOR)"
	.venv-oldest/bin/python -m pytest -q -n 2 --dist loadfile -m "fast and not serial"

test-slow: $(STAMP) ## Run only the multi-process / multi-epoch tests
	$(PYTHON) -m pytest -q -m slow

test-faults: $(STAMP) ## Run only the fault-injection tests: kills, signals, dead ranks, corrupt files
	$(PYTHON) -m pytest -q -m faults

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

synthetic-cifar10: $(STAMP) ## Write SYNTHETIC CIFAR-10 files (real format and size: 50,000 + 10,000) to data/synthetic_cifar10
	$(PYTHON) scripts/make_synthetic_cifar10.py --out data/synthetic_cifar10

# --- GPU machines (e.g. an EC2 g5.12xlarge / p3.8xlarge with the NVIDIA driver installed) ---
gpu-check: ## Show GPUs, their interconnect and what torch sees
	nvidia-smi
	nvidia-smi topo -m
	$(PYTHON) -c "import torch; print('cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count(), 'nccl', torch.distributed.is_nccl_available())"

gpu-verify: ## On a GPU machine: GPU tests + GPU bench rows (MLP, ResNet18; capture on/off) -> bench_results/gpu-<time>/
	PYTHON=$(PYTHON) bash scripts/gpu_verify.sh

train-gpu-ddp: $(STAMP) ## DDP over all GPUS of this machine with nccl
	$(PYTHON) src/train.py trainer=ddp trainer.accelerator=gpu trainer.devices=$(GPUS) $(ARGS)

train-multinode: $(STAMP) ## One node of a multi-node DDP run: set NNODES, NODE_RANK, MASTER_ADDR (node 0's IP), MASTER_PORT
	MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT) NODE_RANK=$(NODE_RANK) \
	$(PYTHON) src/train.py trainer=ddp trainer.num_nodes=$(NNODES) trainer.devices=$(if $(filter 0,$(GPUS)),1,$(GPUS)) $(ARGS)

# --- Clusters: SkyPilot (EC2 and other clouds), hosts you already have, orphaned ranks ---------------------
# SkyPilot runs scripts/cloud/ec2.yaml: NODES nodes of CLOUD_GPUS each, `make install` on every node, then
# scripts/cloud/node_train.sh (torchrun with SkyPilot's node rank and head-node IP). Needs `make cloud-install`
# (or SkyPilot on PATH) and AWS credentials (`aws configure`; `sky check aws` shows what SkyPilot can use).
CLUSTER ?= lhd
CLOUD_TASK ?= scripts/cloud/ec2.yaml
NODES ?= 1
CLOUD_GPUS ?= A10G:4
SPOT ?= 0
AUTOSTOP ?= 30
SKY ?= $(firstword $(wildcard .venv-cloud/bin/sky) sky)
SKY_LAUNCH = $(SKY) launch -c $(CLUSTER) $(CLOUD_TASK) --num-nodes $(NODES) --gpus $(CLOUD_GPUS) \
	$(if $(filter 1,$(SPOT)),--use-spot,--no-use-spot) -i $(AUTOSTOP) -y
# Your own hosts, reached over ssh: HOSTS="ip1 ip2" (node 0 first). SSH is the command that runs a command
# line on a host (`$(SSH) [-i SSH_KEY] SSH_OPTS [SSH_USER@]host 'command'`).
HOSTS ?=
SSH ?= ssh
SSH_USER ?=
SSH_KEY ?=
SSH_OPTS ?= -o BatchMode=yes
REMOTE_DIR ?= $(notdir $(CURDIR))
REMOTE_SETUP ?= make install
NPROC_PER_NODE ?=
PID_DIR ?= logs/.pids
.PHONY: cloud-install cloud-up cloud-train cloud-sweep cloud-logs cloud-ssh cloud-down sync launch-hosts kill-orphans

cloud-install: $(STAMP) ## SkyPilot with AWS support (the `cloud` extra) in its own environment, .venv-cloud
	$(PYTHON) -m venv .venv-cloud  # isolated: SkyPilot's pins never meet the training environment's packages
	.venv-cloud/bin/pip install --quiet $$($(PYTHON) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['cloud']))")
	@echo "SkyPilot: .venv-cloud/bin/sky (used by make cloud-*). Next: aws configure; .venv-cloud/bin/sky check aws"

cloud-up: ## Start or reuse CLUSTER: NODES x CLOUD_GPUS (default 1 x A10G:4), SPOT=1 for spot; stops after AUTOSTOP idle min
	$(SKY_LAUNCH) --env MODE=setup

cloud-train: ## Train on CLUSTER (started if needed), torchrun on every node: ARGS="trainer.max_epochs=20"
	$(SKY_LAUNCH) --fast --env MODE=train --env TRAIN_ARGS="$(ARGS)"

cloud-sweep: ## A Hydra multirun on CLUSTER's head node, all its GPUs per job: ARGS="hparams_search=fashion_mnist_optuna"
	$(SKY_LAUNCH) --fast --env MODE=sweep --env TRAIN_ARGS="$(ARGS)"

cloud-logs: ## Follow the logs of CLUSTER's latest job
	$(SKY) logs $(CLUSTER)

cloud-ssh: ## A shell on CLUSTER's head node (SkyPilot adds the cluster to ~/.ssh/config)
	ssh $(CLUSTER)

cloud-down: ## Tear CLUSTER down: its instances and disks stop costing money
	$(SKY) down -y $(CLUSTER)

sync: ## rsync this repo to REMOTE_DIR on every host of HOSTS (files in .gitignore, e.g. logs/ and data/, stay put)
	@test -n "$(HOSTS)" || { echo 'error: no hosts; set HOSTS="ip1 ip2"' >&2; exit 2; }
	for host in $(HOSTS); do \
	  rsync -az --delete-after --exclude=.git --filter=':- .gitignore' -e "$(SSH) $(if $(SSH_KEY),-i $(SSH_KEY)) $(SSH_OPTS)" \
	    ./ "$(if $(SSH_USER),$(SSH_USER)@)$$host:$(REMOTE_DIR)/" || exit 1; \
	done

launch-hosts: ## One torchrun per host over ssh, node rank = position in HOSTS: HOSTS="ip1 ip2" ARGS="..." [NPROC_PER_NODE=4]
	HOSTS="$(HOSTS)" SSH="$(SSH)" SSH_USER="$(SSH_USER)" SSH_KEY="$(SSH_KEY)" SSH_OPTS="$(SSH_OPTS)" \
	REMOTE_DIR="$(REMOTE_DIR)" REMOTE_SETUP="$(REMOTE_SETUP)" NPROC_PER_NODE="$(NPROC_PER_NODE)" \
	MASTER_PORT="$(MASTER_PORT)" PYTHON="$(PYTHON)" bash scripts/cloud/launch_hosts.sh $(ARGS)

kill-orphans: ## End this project's ranks whose launcher is gone, by PID (from PID_DIR), here or on every host of HOSTS
ifeq ($(strip $(HOSTS)),)
	$(PYTHON) scripts/cloud/kill_orphans.py --pid-dir "$(PID_DIR)"
else
	for host in $(HOSTS); do \
	  $(SSH) $(if $(SSH_KEY),-i $(SSH_KEY)) $(SSH_OPTS) "$(if $(SSH_USER),$(SSH_USER)@)$$host" \
	    "cd $(REMOTE_DIR) && $(PYTHON) scripts/cloud/kill_orphans.py --pid-dir $(PID_DIR)"; \
	done
endif

clean-logs: ## Remove logs/: every run's checkpoints, metrics, configs and MLflow store
	rm -rf logs/

clean: ## Remove caches and the install stamp (keeps data/ and logs/)
	rm -rf .make .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
