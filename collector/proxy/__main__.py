"""``python -m kvscope.collector.proxy``: the proxy without the ``kvscope`` CLI."""

from __future__ import annotations

import argparse
import logging
import sys

from kvscope.collector.proxy.app import add_proxy_arguments, main_proxy
from kvscope.errors import KvscopeError


def main() -> int:
    """Parse the proxy flags and run it."""
    parser = argparse.ArgumentParser(
        prog="kvscope proxy", description="Instrumented vLLM multi-turn P/D proxy"
    )
    add_proxy_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s [%(levelname)s] %(name)s: %(message)s")
    try:
        return main_proxy(args)
    except KvscopeError as exc:
        print(f"kvscope proxy: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
