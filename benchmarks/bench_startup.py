"""How long ``diffserve serve`` takes to become ready, and the CPU each of its processes used then
(``/proc/<pid>/stat``), over ``--rounds`` fresh starts.

    python benchmarks/bench_startup.py --model tiny-sd --rounds 3
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kit import cli, servers


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def processes(root: int) -> dict[str, int]:
    """The server's processes by title (the frontend is ``root``). The launcher starts it in a
    session of its own: only that session counts, not another server running on the machine."""
    found = {"diffserve::frontend": root}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(stat_fields(int(entry.name))[3]) == root:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
                if title.startswith("diffserve::") and title != "diffserve::frontend":
                    found[title.split()[0]] = int(entry.name)
        except OSError:
            continue
    return found


def one_start(args) -> dict[str, float]:
    server = servers.server("--model", args.model, "--torch-threads", "1", *args.extra, env={"OMP_NUM_THREADS": "1"})
    started = time.monotonic()
    with server:
        found = {"ready_s": time.monotonic() - started}
        for title, pid in processes(server.proc.pid).items():
            user, system = stat_fields(pid)[11:13]
            found[f"{title} cpu_s"] = (int(user) + int(system)) / os.sysconf("SC_CLK_TCK")
    return found


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, model="tiny-sd", rounds=3, output_file=None)
    p.add_argument("extra", nargs="*", help="more `diffserve serve` arguments (after --)")
    args = p.parse_args(argv)
    cli.report("startup", [{"figures": one_start(args)} for _ in range(args.rounds)], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
