"""Command line: ``diffserve serve`` (flags generated from :class:`ServerConfig`),
``diffserve models`` and ``diffserve calibrate``."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from diffserve.config.flags import ConfigError, ServerConfig


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    from diffserve.config.speed import SpeedOptions

    speed = {f.name for f in dataclasses.fields(SpeedOptions)}
    group = parser.add_argument_group("speed (step cache, compilation, quantization, attention)")
    for f in sorted(dataclasses.fields(ServerConfig), key=lambda f: f.name in speed):
        meta = f.metadata
        target = group if f.name in speed else parser
        bounds = []
        if meta.get("ge") is not None:
            bounds.append(f">= {meta['ge']:g}")
        if meta.get("le") is not None:
            bounds.append(f"<= {meta['le']:g}")
        extra = f" Bounds: {', '.join(bounds)}." if bounds else ""
        if meta.get("env"):
            extra += f" Env: {meta['env']}."
        default = f.default if f.default not in ("", ()) else "(unset)"
        flag, kind = "--" + f.name.replace("_", "-"), type(f.default)
        help_text = f"{meta['help']} Default: {default}.{extra}"
        if kind is bool:  # a switch; unset stays None so the environment or default applies
            target.add_argument(flag, dest=f.name, action="store_const", const=True, default=None,
                                help=help_text)
        elif meta.get("repeat"):  # a text flag given once or more (--model a=X --model b=Y)
            target.add_argument(flag, dest=f.name, action="append", default=None,
                                metavar=meta.get("metavar") or kind.__name__.upper(),
                                help=help_text)
        elif kind is tuple:  # several values after one flag, or the flag repeated
            target.add_argument(flag, dest=f.name, nargs="+", action="extend", default=None,
                                metavar=meta.get("metavar") or "VALUE", help=help_text)
        else:
            target.add_argument(
                flag, dest=f.name, type=kind, choices=meta.get("choices"), default=None,
                metavar=None if meta.get("choices") else meta.get("metavar") or kind.__name__.upper(),
                help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Serve a diffusion model over an OpenAI-style HTTP API.",
                           description="Serve a diffusion model over an OpenAI-style HTTP API.")
    _add_config_flags(serve)
    sub.add_parser("models", help="List the packaged and embedded models, and the random-weight "
                   "architectures.")
    sub.add_parser("calibrate", add_help=False,
                   help="Measure step time against cost on a model and device; suggest "
                   "--max-batch-cost and --max-running-cost (diffserve calibrate --help).")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        from diffserve.calibrate import main as calibrate

        return calibrate(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "models":
        from diffserve.config.flags import DEFAULT_MODEL
        from diffserve.builders.embedded import EMBEDDED, EMBEDDED_CONTROLNETS, PACKAGED
        from diffserve.executor.families import architectures

        for name, (description, _) in {**PACKAGED, **EMBEDDED}.items():
            marker = " (default)" if name == DEFAULT_MODEL else ""
            print(f"{name}{marker}: {description}")
        for name, (description, base, _) in EMBEDDED_CONTROLNETS.items():
            print(f"{name} (--controlnet NAME={name}, with --model {base}): {description}")
        for name, arch in architectures().items():
            print(f"random:{name}[:tiny]: {arch.description}; random weights, built in memory "
                  "(:tiny: the same structure, few and narrow layers, for a CPU)")
        return 0
    try:
        config = ServerConfig.from_mapping(vars(args))
    except ConfigError as error:
        print(f"diffserve serve: error: {error}", file=sys.stderr)
        return 2
    from diffserve.serving.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
