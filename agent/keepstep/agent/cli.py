"""The `keepstep` command line.

`keepstep selfcheck` checks that this machine gives bit-identical parameters for any rank
count. (The node agent's `keepstep run` lives beside it.)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from keepstep.elastic.errors import KeepstepError
from keepstep.elastic.selfcheck import selfcheck


def _ranks(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ranks {text!r}: expected a comma-separated list of integers such as 1,2,3,4"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("--ranks needs at least one rank count")
    return values


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    runs = selfcheck(args.ranks, steps=args.steps, mode=args.mode)
    identical = len({r.params_sha256 for r in runs}) == 1
    if args.json:
        print(
            json.dumps(
                {
                    "runs": [
                        {
                            "ranks": r.ranks,
                            "params_sha256": r.params_sha256,
                            "seconds": round(r.seconds, 2),
                        }
                        for r in runs
                    ],
                    "identical": identical,
                }
            )
        )
    else:
        for r in runs:
            print(f"ranks={r.ranks:<3} params_sha256={r.params_sha256}  ({r.seconds:.1f} s)")
        print("identical" if identical else "NOT identical: numbers depend on the rank count")
    return 0 if identical else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keepstep", description="Elastic PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("selfcheck", help="check bit-identical parameters across rank counts")
    check.add_argument("--ranks", type=_ranks, default=[1, 2, 3, 4])
    check.add_argument("--steps", type=int, default=30)
    check.add_argument("--mode", choices=["exact", "fast"], default="exact")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_selfcheck)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeepstepError as error:
        print(f"keepstep: error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
