"""Generate the tiny-lm demo model: python scripts/make_tiny_lm.py OUT_DIR [--seed N]."""

from __future__ import annotations

import argparse

from sluice.engines.generative.tiny import make_tiny_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_lm(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
