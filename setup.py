from setuptools import find_packages, setup

setup(
    name="hybridlm",
    version="0.1.0",
    description="Megatron-style tensor/sequence/pipeline-parallel GPT training inside DeepSpeed, with ZeRO and offload.",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridlm", "hybridlm.*"]),
    package_data={"hybridlm.data": ["builtin/*.jsonl.gz"],
                  # the fused kernels' sources (ops/csrc, linked as hybridlm/ops/csrc; find_packages and the
                  # wheel build follow the links, so hybridlm/ops/op_builder comes too): JIT-built on first use
                  "hybridlm.ops": ["csrc/*.h", "csrc/cpu/*.cpp", "csrc/cuda/*.h", "csrc/cuda/*.cuh", "csrc/cuda/*.cpp", "csrc/cuda/*.cu"]},
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
        "dev": ["pytest", "transformers", "wandb", "tensorboard", "mpi4py"],
        "gpu": ["flash-attn", "transformer-engine[pytorch]"],
        "bench": ["matplotlib"],  # benchmarks/headline.png (python -m benchmarks render)
    },
)
