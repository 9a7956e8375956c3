"""`keepstep checkpoint`: list the durable checkpoints at a URL, or export one as plain
state dicts that open without keepstep.

    keepstep checkpoint ls URL [--json] [--quick]
    keepstep checkpoint export URL OUT [--step N] [--format torch|safetensors] [--force]

Where it sits: `keepstep.cli.build_parser` calls `register(sub)`. A command checks its
arguments first: OUT (exists without --force, no such directory), the format's package,
then the URL as `keepstep run --resume` checks it (scheme, S3 credentials;
KEEPSTEP_S3_ENDPOINT names an S3-compatible endpoint). Only then is storage read
(catalog.py) and, to decode a blob, torch imported (contents.py, export.py).

Exit status: 0 done; 1 the step to export is damaged, missing or incomplete, or (for `ls`)
no step is intact; 2 a bad argument, which includes a URL holding no checkpoint and a
--step that is not there (the message lists the steps that are).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepstep.argtypes import int_at_least, seconds
from keepstep.errors import ConfigError, KeepstepError

if TYPE_CHECKING:
    from keepstep.agent.durable.storage import Location
    from keepstep.checkpoint.catalog import Catalog

FORMATS = ("torch", "safetensors")
TIMEOUT_S = 600.0  # one listing or one blob read; a large blob from a slow store takes long
_TIMEOUT_HELP = f"seconds allowed for listing the URL, and for reading one blob [{TIMEOUT_S:g}]"


def register(sub: Any) -> None:
    """Add `checkpoint` (with `ls` and `export`) to the `keepstep` subcommands."""
    parser = sub.add_parser(
        "checkpoint",
        help="list durable checkpoints, or export one as plain state dicts",
        description="Durable checkpoints written by `keepstep run --checkpoint URL` (or the "
        "operator), opened without keepstep.",
    )
    verbs = parser.add_subparsers(dest="checkpoint_command", required=True, metavar="VERB")
    ls = verbs.add_parser(
        "ls",
        help="list the steps at URL with their hashes",
        description="Every step with files at URL: its status, when it was written, its size "
        "and the params_sha256 a job reports for that state (each blob is read, verified "
        "and decoded; --quick reads the records only). The newest intact step is the one "
        "`keepstep run --resume URL` starts from.",
    )
    ls.add_argument("url", metavar="URL", help="where the checkpoints are (file:///dir, s3://...)")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.add_argument(
        "--quick",
        action="store_true",
        help="read the records only: no blob is read, verified or hashed",
    )
    ls.add_argument("--timeout", type=seconds, default=TIMEOUT_S, help=_TIMEOUT_HELP)
    ls.set_defaults(func=_cmd_ls)
    export = verbs.add_parser(
        "export",
        help="write one step as plain state dicts (torch.save or safetensors)",
        description="Write the model, optimizer and tracked script state of one step to OUT. "
        "--format torch: a dict that torch.load(OUT, weights_only=True) opens, with "
        "'model', 'optimizer' and 'state' (each a state_dict), 'step' and 'params_sha256'. "
        "--format safetensors: the model's tensors, with the step and hash as metadata.",
    )
    export.add_argument("url", metavar="URL", help="where the checkpoints are")
    export.add_argument("out", metavar="OUT", help="the file to write (a local path)")
    export.add_argument(
        "--step", type=int_at_least(0), help="the step to export [the newest complete one]"
    )
    export.add_argument(
        "--format", choices=FORMATS, default="torch", help="the file's format [torch]"
    )
    export.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    export.add_argument("--timeout", type=seconds, default=TIMEOUT_S, help=_TIMEOUT_HELP)
    export.set_defaults(func=_cmd_export)


def _cmd_ls(args: argparse.Namespace) -> int:
    from keepstep.checkpoint.catalog import scan

    loc = _location(args.url)
    catalog = scan(loc, args.timeout)
    if not args.quick:
        catalog = _verified(loc, catalog, args.timeout)
    newest = catalog.newest()
    if args.json:
        listing = {
            "url": catalog.url,
            "latest": catalog.latest,
            "note": catalog.note,
            "newest": None if newest is None else newest.step,
            "verified": not args.quick,
            "steps": [s.to_json() for s in catalog.steps],
        }
        print(json.dumps(listing, indent=1))
    else:
        _print_listing(catalog, args.quick)
    return 0 if newest is not None else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from keepstep.checkpoint.catalog import read_blob, scan

    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"OUT {out}: is a directory; name the file to write")
    if out.exists() and not args.force:
        raise ConfigError(f"OUT {out}: exists; --force overwrites it")
    if not out.parent.is_dir():
        raise ConfigError(f"OUT {out}: no directory {out.parent} to write it in")
    if args.format == "safetensors" and importlib.util.find_spec("safetensors") is None:
        raise KeepstepError(
            "--format safetensors needs the safetensors package, which is not installed: "
            "pip install safetensors (or use --format torch)"
        )
    loc = _location(args.url)
    catalog = scan(loc, args.timeout)
    step = catalog.pick(args.step)
    from keepstep.checkpoint.contents import decode  # imports torch
    from keepstep.checkpoint.export import Format, write
    from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing

    try:
        contents = decode(step.step, read_blob(loc, step, args.timeout))
    except (SnapshotCorrupt, SnapshotMissing) as e:
        others = [str(s.step) for s in catalog.steps if s.step != step.step]
        hint = f"; other steps there (--step N): {', '.join(others)}" if others else ""
        raise type(e)(f"{e}{hint}") from None
    assert step.info is not None  # read_blob refuses a step without a record
    if contents.sharded and args.format == "torch":
        raise ConfigError(
            f"{step.info.url}: step {step.step} is a sharded job's checkpoint "
            f"({step.info.parts} parts), whose optimizer state is in pieces: "
            "--format safetensors exports its model; keepstep run --resume continues it"
        )
    nbytes = write(contents, step.info.url, out, Format(args.format), force=args.force)
    what = f"model ({len(contents.model)} tensors)"
    if args.format == "torch":
        groups = contents.optimizer["param_groups"]
        what += f", optimizer ({sum(len(g['params']) for g in groups)} parameters)"
        what += f", state ({', '.join(contents.state) or 'none tracked'})"
    print(f"wrote {out}: step {contents.step}, {nbytes} B, {args.format}: {what}")
    print(f"params_sha256 {contents.params_sha256}")
    return 0


def _location(url: str) -> Location:
    """The URL checked as `keepstep run --resume` checks it; the environment is read here."""
    from keepstep.agent.durable.storage import check_command_line_url, storage_options_from_env

    env = dict(os.environ)
    home = env.get("HOME") or os.path.expanduser("~")
    return check_command_line_url("URL", url, storage_options_from_env(env), env, home)


def _verified(loc: Location, catalog: Catalog, timeout: float) -> Catalog:
    """``catalog`` with every published step's blob read, verified and hashed, one at a time."""
    from keepstep.checkpoint.catalog import Status, intact, read_blob, unreadable
    from keepstep.checkpoint.contents import decode  # imports torch
    from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing

    steps = []
    for step in catalog.steps:
        if step.status is Status.PUBLISHED:
            try:
                contents = decode(step.step, read_blob(loc, step, timeout))
            except (SnapshotCorrupt, SnapshotMissing) as e:
                step = unreadable(step, e)
            else:
                step = intact(step, contents.params_sha256, contents.state_sha256)
        steps.append(step)
    return dataclasses.replace(catalog, steps=tuple(steps))


def _print_listing(catalog: Catalog, quick: bool) -> None:
    newest = catalog.newest()
    print(f"{catalog.url}: {catalog.note}")
    print(f"{'step':>8}  {'status':<10}  {'written':<19}  {'bytes':>12}  params_sha256")
    for s in catalog.steps:
        info = s.info
        written = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.written_at)) if info else ""
        )
        size = str(info.nbytes) if info else ""
        mark = "  newest" if s is newest else ""
        sha = s.params_sha256 or "-"
        print(f"{s.step:>8}  {s.status.value:<10}  {written:<19}  {size:>12}  {sha}{mark}")
        for name, digest in s.state_sha256.items():
            print(f"{'':>8}  state {name:<30}  {'':>12}  {digest}")
        if s.reason:
            print(f"{'':>8}  {s.reason}")
    if quick:
        print("(--quick: no blob was read; without it each is verified and hashed)")
    if newest is None:
        print("no intact checkpoint: nothing to resume from or export")
