"""Import a local Hugging Face Llama / Mistral / Qwen2 / Mixtral (or GPT-2) model as a hybridlm checkpoint.

    python scripts/convert_from_hf.py --hf hf_dir/ --output ckpt/ --tp 2 --pp 2 [--ep 2]
    deepspeed scripts/pretrain.py --config ckpt/config.yaml --load ckpt/ --save ckpt/ --data-path ... [--finetune]

The checkpoint holds weights only (pretrain.py starts a fresh optimizer at iteration 0) and
loads at any layout, not only the one it was written at. Weights are read from safetensors only.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.config import ConfigError  # noqa: E402
from hybridlm.interop.export import DTYPES  # noqa: E402
from hybridlm.interop.import_ import import_from_hf  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="A local Hugging Face model directory (config.json + safetensors).")
    parser.add_argument("--output", required=True, help="New directory for the hybridlm checkpoint.")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1, help="Tensor-parallel size.")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1, help="Pipeline stages.")
    parser.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1, help="Expert-parallel size (MoE).")
    parser.add_argument("--seq-length", type=int, default=None, help="Training sequence length (default: the model's, at most 4096).")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="Store weights in this dtype (default: as in the safetensors).")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    args = parser.parse_args(argv)
    try:
        import_from_hf(args.hf, args.output, tp=args.tp, pp=args.pp, ep=args.ep, seq_length=args.seq_length,
                       dtype=args.dtype, progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
