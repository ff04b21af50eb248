#!/usr/bin/env bash
# kiln's float64 reference (test/ref/gen_arch_ref.py) against HuggingFace's
# LlamaForCausalLM and MixtralForCausalLM on the same weights (logits, loss,
# gradients to 1e-10), and the committed test/ref/hf_llama_ref.bin against HF
# fp32 as installed: test/ref/hf_llama_check.py. The interpreter is
# $KILN_HF_PY (default .venv-hf/bin/python, made by scripts/setup_hf.sh).
# Prints "skip ..." when transformers is not installed there.
set -u
cd "$(dirname "$0")/.."
py=${KILN_HF_PY:-.venv-hf/bin/python}
if [ ! -x "$py" ] || ! "$py" -c 'import torch, transformers' 2>/dev/null; then
    echo "skip hf_llama_reference: transformers not installed ($py; scripts/setup_hf.sh makes it)"
    exit 0
fi
out=$("$py" test/ref/hf_llama_check.py 2>&1)
rc=$?
if [ $rc -eq 0 ]; then
    echo "ok hf_llama_reference"
else
    echo "FAIL hf_llama_reference: $(printf '%s\n' "$out" | grep -E '^FAIL|Error' | head -n 3 | tr '\n' ' ')"
fi
