from setuptools import find_packages, setup

setup(
    name="hybridlm",
    version="0.1.0",
    description="Megatron-style tensor/sequence/pipeline-parallel GPT training inside DeepSpeed, with ZeRO and offload.",
    python_requires=">=3.10",
    # the fused kernels' builders and sources sit in the top-level ops/ (DeepSpeed's layout) and install
    # as hybridlm/ops/op_builder and hybridlm/ops/csrc, beside each other, where the builders look
    packages=find_packages(include=["hybridlm", "hybridlm.*"]) + ["hybridlm.ops.op_builder", "hybridlm.ops.csrc"],
    package_dir={"hybridlm.ops.op_builder": "ops/op_builder", "hybridlm.ops.csrc": "ops/csrc"},
    package_data={"hybridlm.data": ["builtin/*.jsonl.gz"],
                  "hybridlm.ops.csrc": ["*.h", "cpu/*.cpp", "cuda/*.h", "cuda/*.cuh", "cuda/*.cpp", "cuda/*.cu"]},
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19",  # 0.19.8 tested
        "numpy",
        "tokenizers>=0.20",
        "zstandard",  # .jsonl.zst input to preprocess_data
        "pyyaml",
        "safetensors",
        "sentencepiece",  # --tokenizer-type Llama2Tokenizer
        "jinja2>=3.1.6",  # chat templates (preprocess_chat); the sandbox fixes of 3.1.6, as transformers requires
    ],
    extras_require={
        "dev": ["pytest", "pytest-xdist", "transformers", "wandb", "tensorboard", "mpi4py", "math-verify", "peft", "bitsandbytes>=0.50"],
        "post": ["math-verify"],  # GRPO's accuracy reward (--reward-funcs accuracy)
        "qlora": ["bitsandbytes>=0.50"],  # --quant-bits 4 (0.50.2 tested; its 4-bit kernels run on CPU too)
        "gpu": ["flash-attn", "transformer-engine[pytorch]", "nvidia-ml-py"],  # nvidia-ml-py: NVML utilisation in the monitor
        "bench": ["matplotlib"],  # benchmarks/headline.png (python -m benchmarks render)
    },
)
