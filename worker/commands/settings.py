"""`keyword-embedder settings`: the settings reference, or the settings in effect."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.settings.docs import reference_markdown
from worker.settings.loader import add_setting_flags, load_settings
from worker.settings.schema import SettingsError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true",
                        help="Print the reference (docs/settings.md): "
                             "keyword-embedder settings --markdown > docs/settings.md")
    parser.add_argument("--write", metavar="FILE", default=None,
                        help="With --markdown: write the reference to FILE instead of printing it.")
    add_setting_flags(parser)


def main(args: argparse.Namespace) -> int:
    if args.markdown:
        text = reference_markdown()
        if args.write:
            Path(args.write).write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
        return 0
    if args.write:
        print("keyword-embedder: --write needs --markdown", file=sys.stderr)
        return 2
    try:
        settings = load_settings(args)
    except SettingsError as exc:
        print(f"keyword-embedder: {exc}", file=sys.stderr)
        return 2
    # Secrets (sasl_password, secret kafka_config values) are masked; the password file is not read.
    for key, value in settings.redacted().items():
        print(f"{key} = {value!r}")
    return 0
