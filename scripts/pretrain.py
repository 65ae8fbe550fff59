"""Pre-train a GPT: `deepspeed scripts/pretrain.py --deepspeed_config ds_configs/zero1.json [flags]`.

With no other flag it trains the built-in tiny model on the built-in corpus; every flag
is listed by --help and in the README.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.training.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
