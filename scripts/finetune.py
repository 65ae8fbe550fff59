"""Fine-tune a model: `deepspeed scripts/finetune.py --task sft|dpo --load ckpt/ --data-path data/chat [flags]`,
or learn from rewards: `deepspeed scripts/finetune.py --task grpo --load ckpt/ --data-path prompts.jsonl --reward-funcs accuracy`.

ckpt/ is what convert_from_hf.py writes (or any hybridlm checkpoint): its model and tokenizer
settings come with it. SFT and DPO data comes from preprocess_chat.py; GRPO reads prompts from
JSONL. Every pretrain.py flag works here.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.training.finetune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
