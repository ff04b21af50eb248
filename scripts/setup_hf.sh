#!/usr/bin/env bash
# Make .venv-hf (or $KILN_HF_VENV): a venv over Debian's torch 1.13
# (/usr/bin/python3, --system-site-packages) with transformers==4.46.3 and
# safetensors, for test/t_hf_llama.sh. Idempotent. Without torch in
# /usr/bin/python3 it says so and exits 0: the HF check then skips.
set -u
cd "$(dirname "$0")/.."
venv=${KILN_HF_VENV:-.venv-hf}
sys_py=/usr/bin/python3
if ! "$sys_py" -c 'import torch' 2>/dev/null; then
    echo "setup_hf: $sys_py has no torch (apt-get install python3-torch); HF checks will skip"
    exit 0
fi
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import transformers, safetensors; assert transformers.__version__ == "4.46.3"' 2>/dev/null; then
    exit 0
fi
[ -x "$venv/bin/python" ] || "$sys_py" -m venv --system-site-packages "$venv" || { echo "setup_hf: venv $venv failed" >&2; exit 1; }
if ! "$venv/bin/pip" install -q transformers==4.46.3 safetensors; then
    echo "setup_hf: pip install transformers==4.46.3 safetensors failed" >&2
    exit 1
fi
echo "setup_hf: $venv ready (transformers 4.46.3)"
