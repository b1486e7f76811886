"""``python -m compile_attn``: the ``compile-attn`` command (see ``compile_attn.cli``)."""

import sys

from compile_attn.cli import main

if __name__ == "__main__":
    sys.exit(main())
