#!/usr/bin/env bash
# Set up everything the project needs on a fresh Debian machine:
# a virtual environment in .venv with the package and its extras (test, lint, bench, train and
# torch: torch, transformers and peft on the CPU, without which their tests skip), and,
# when wgpu finds no Vulkan adapter, Debian's software Vulkan driver (lavapipe); and, when
# no Chromium is there, Debian's chromium (the browser tests' WebGPU).
# Sourced by demo.sh and test.sh; safe to run again (it skips what is done).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($py --version)"
    $py -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
    echo "[setup] installing shaderdsl with its test, lint, bench, train and torch extras into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    if ! .venv/bin/python -m pip install -q -e ".[test,lint,bench,train,torch]"; then
        echo "[setup] could not install the torch extra (torch, transformers, peft): the tests" >&2
        echo "        that compare with them will skip, saying why. To run them later:" >&2
        echo "        .venv/bin/python -m pip install -e '.[torch]' (torch's CPU wheel, 190 MB:" >&2
        echo "        add --extra-index-url https://download.pytorch.org/whl/cpu)" >&2
        .venv/bin/python -m pip install -q -e ".[test,lint,bench,train]"
    fi
    touch "$stamp"
fi

# Lavapipe warns unless XDG_RUNTIME_DIR names a private folder.
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "${XDG_RUNTIME_DIR}" ]; then
    export XDG_RUNTIME_DIR=/tmp/xdg-runtime-$(id -u)
    mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
fi

has_adapter() {  # $1: a backend name, or empty for any
    .venv/bin/python -c "import wgpu, sys; b = sys.argv[1]; sys.exit(0 if any(not b or a.info['backend_type'] == b for a in wgpu.gpu.enumerate_adapters_sync()) else 1)" "${1:-}" 2>/dev/null
}
# The default run is on Vulkan: a machine with only Mesa's OpenGL driver gets lavapipe too.
if ! has_adapter Vulkan; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[setup] no Vulkan adapter: installing Debian's mesa-vulkan-drivers (lavapipe)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq mesa-vulkan-drivers >/dev/null
    fi
    if ! has_adapter; then
        echo "[setup] no WebGPU adapter found. Install a Vulkan driver (on Debian, as root:" >&2
        echo "        apt-get install mesa-vulkan-drivers) or a GPU driver, then run again." >&2
        exit 1
    fi
fi

# The browser tests (tests/test_browser.py, tests/test_export.py) run kernels in headless
# Chromium's WebGPU; without a browser they skip. Install Debian's when root and absent.
if [ -z "${SHADERDSL_CHROMIUM:-}" ] && ! command -v chromium >/dev/null && \
   ! command -v chromium-browser >/dev/null && ! command -v google-chrome >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[setup] no Chromium: installing Debian's chromium (for the browser tests)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq chromium >/dev/null || \
            echo "[setup] could not install chromium: the browser tests will skip" >&2
    else
        echo "[setup] no Chromium found: the browser tests will skip (install chromium, or set" >&2
        echo "        SHADERDSL_CHROMIUM to a Chrome or Chromium binary)" >&2
    fi
fi

# The Node tests (tests/test_node_modules.py, marker node) run the exported modules on Dawn's
# webgpu npm package (on Chromium's SwiftShader Vulkan driver where there is no GPU) and check
# their declarations with TypeScript. Installed from npm into a cache outside the project
# ($SHADERDSL_NODE_MODULES names another node_modules); without node, npm or the registry
# those tests skip, saying why. (webgpu's install script only matters on macOS.)
if ! command -v node >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] no node: installing Debian's nodejs and npm (for the Node tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq nodejs npm >/dev/null || \
        echo "[setup] could not install nodejs: the Node tests will skip" >&2
fi
node_cache=${SHADERDSL_NODE_MODULES:-$HOME/.cache/shaderdsl-node/node_modules}
node_packages="webgpu@0.6.2 typescript@5.9 @webgpu/types@0.1"
node_stamp="$node_cache/.installed-$(echo "$node_packages" | sha1sum | cut -c1-12)"
if command -v node >/dev/null && command -v npm >/dev/null && [ ! -f "$node_stamp" ]; then
    echo "[setup] installing $node_packages from npm into $(dirname "$node_cache")"
    mkdir -p "$(dirname "$node_cache")"
    if (cd "$(dirname "$node_cache")" && { [ -f package.json ] || echo '{"private": true}' > package.json; } &&
        npm install -q --no-audit --no-fund --ignore-scripts $node_packages >/dev/null); then
        touch "$node_stamp"
    else
        echo "[setup] could not install the node packages: the Node tests will skip" >&2
    fi
fi
