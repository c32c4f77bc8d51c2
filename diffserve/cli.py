"""Command line: ``diffserve serve`` (flags generated from :class:`ServerConfig`) and
``diffserve models``."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from diffserve.config import ConfigError, ServerConfig


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServerConfig):
        meta = f.metadata
        bounds = []
        if meta.get("ge") is not None:
            bounds.append(f">= {meta['ge']:g}")
        if meta.get("le") is not None:
            bounds.append(f"<= {meta['le']:g}")
        extra = f" Bounds: {', '.join(bounds)}." if bounds else ""
        if meta.get("env"):
            extra += f" Env: {meta['env']}."
        default = f.default if f.default != "" else "(unset)"
        parser.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default),
            choices=meta.get("choices"), default=None, metavar=None if meta.get("choices") else
            type(f.default).__name__.upper(),
            help=f"{meta['help']} Default: {default}.{extra}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Serve a diffusion model over an OpenAI-style HTTP API.",
                           description="Serve a diffusion model over an OpenAI-style HTTP API.")
    _add_config_flags(serve)
    sub.add_parser("models", help="List the embedded models.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "models":
        from diffserve.config import DEFAULT_MODEL
        from diffserve.models.embedded import EMBEDDED, PACKAGED

        for name, (description, _) in {**PACKAGED, **EMBEDDED}.items():
            marker = " (default)" if name == DEFAULT_MODEL else ""
            print(f"{name}{marker}: {description}")
        return 0
    try:
        config = ServerConfig.from_mapping(vars(args))
    except ConfigError as error:
        print(f"diffserve serve: error: {error}", file=sys.stderr)
        return 2
    from diffserve.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
