#!/usr/bin/env bash
# Install everything the project needs on a fresh machine: Python packages, and, where apt is available,
# Debian's offline Fashion-MNIST (the default training data) and rsync (`make sync`). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
[ -d /usr/share/datasets/fashion-mnist ] || missing+=(dataset-fashion-mnist)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
    echo "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    for package in "${missing[@]}"; do
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$package" \
        || echo "$package is not in this distribution (Fashion-MNIST is then downloaded on first use; make sync needs rsync)"
    done
  else
    echo "apt-get not found: Fashion-MNIST is downloaded on first use (needs internet); make sync needs rsync"
  fi
fi

PYTHON="${PYTHON:-python}"
# hydra-optuna-sweeper, which hparams_search used before hydra/sweeper=optuna (src/engine/search/), pins Optuna 2 and
# registers Hydra configs of the same names (hydra/sweeper/optuna, hydra/sweeper/sampler/tpe): remove it
if "$PYTHON" -m pip show hydra-optuna-sweeper >/dev/null 2>&1; then
  "$PYTHON" -m pip uninstall --yes --quiet hydra-optuna-sweeper
fi
# torch is resolved by pip like any other dependency (>=2.14, what CI runs); pin it first if you need a specific build.
"$PYTHON" -m pip install --quiet -e ".[dev,loggers,sweep,export]"
"$PYTHON" -c "import torch, lightning, hydra, optuna; print(f'torch {torch.__version__}, lightning {lightning.__version__}, hydra {hydra.__version__}, optuna {optuna.__version__}')"
