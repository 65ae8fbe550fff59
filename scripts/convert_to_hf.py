"""Export a hybridlm checkpoint (any TP/PP/DP/EP layout, ZeRO 0-3) to a Hugging Face directory.

    python scripts/convert_to_hf.py --checkpoint runs/x/global_step1000 --output hf_out/ [--dtype bf16] [--merge-lora]
    python scripts/convert_to_hf.py --checkpoint runs/lora --output adapter/ --peft-adapter

The result loads offline with transformers.AutoModelForCausalLM.from_pretrained(hf_out/):
LlamaForCausalLM for dense models (Qwen2ForCausalLM with query/key/value biases only),
MixtralForCausalLM for MoE, GPT2LMHeadModel for the GPT-2 style variant.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.config import ConfigError  # noqa: E402
from hybridlm.interop.export import DTYPES, export_to_hf  # noqa: E402
from hybridlm.interop.peft_adapter import export_peft_adapter  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="A global_step<N> folder, or a run directory (its latest checkpoint).")
    parser.add_argument("--output", required=True, help="New directory for the Hugging Face model.")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="Weight dtype (default: the training precision).")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard (default 5GB).")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    parser.add_argument("--merge-lora", action="store_true",
                        help="A LoRA checkpoint: write W + (alpha/R) B A for each adapted weight, a plain model "
                             "(QLoRA: W is the 4-bit base dequantized, as the run computed with it).")
    parser.add_argument("--peft-adapter", action="store_true",
                        help="A LoRA or QLoRA checkpoint: write only the adapters, as PEFT's adapter_config.json and "
                             "adapter_model.safetensors, which PeftModel.from_pretrained loads onto the base model.")
    parser.add_argument("--base-model", default=None,
                        help="With --peft-adapter: the base model's name or path, recorded as base_model_name_or_path.")
    args = parser.parse_args(argv)
    try:
        if args.merge_lora and args.peft_adapter:
            raise ConfigError("--merge-lora and --peft-adapter write different things (a whole model, the adapters alone); give one.")
        if args.base_model and not args.peft_adapter:
            raise ConfigError("--base-model names the base in a PEFT adapter's config; it needs --peft-adapter.")
        if args.peft_adapter:
            export_peft_adapter(args.checkpoint, args.output, dtype=args.dtype, base_model=args.base_model)
        else:
            export_to_hf(args.checkpoint, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                         progress=not args.no_progress, merge_lora=args.merge_lora)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
