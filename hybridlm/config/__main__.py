"""``python -m hybridlm.config --markdown`` prints the README's flag table, ``--megatron-markdown``
its table of Megatron-LM's other flags (hybridlm/config/megatron.py)."""
import sys

from . import megatron
from .cli import flags_markdown

if "--markdown" in sys.argv:
    print(flags_markdown())
if "--megatron-markdown" in sys.argv:
    print(megatron.markdown())
