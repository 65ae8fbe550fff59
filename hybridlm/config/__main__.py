"""``python -m hybridlm.config --markdown`` prints the README's flag table."""
import sys

from .cli import flags_markdown

if "--markdown" in sys.argv:
    print(flags_markdown())
