"""`kvflow` entry point. Sub-command groups live in their own modules and are registered here.

Every user error (KVFlowError, a bad option) ends as one line on stderr and exit code 2 — no traceback.
"""

from __future__ import annotations

import os
import sys

import typer

try:  # typer >= 0.20 vendors click; older typer uses click itself
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover
    from click import exceptions as cx

from kvflow.config import warn_unknown_env
from kvflow.errors import KVFlowError

app = typer.Typer(help="kvflow: exact, fast KV-cache restoration for long contexts.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
bench_app = typer.Typer(help="Benchmarks: each prints a table and writes JSON + PNG.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _register() -> None:
    # Imported here so `kvflow --help` stays fast and each group owns its module.
    from kvflow.cli import model_cmds  # noqa: F401  (models, profile, demo)
    for optional in ("pool_cmds", "restore_cmds", "pipeline_cmds", "serve_cmds", "shared_cmds", "faults_cmds",
                     "connector_cmds", "elastic_cmds", "advise_cmds"):
        try:
            __import__(f"kvflow.cli.{optional}")
        except ModuleNotFoundError as err:
            if err.name != f"kvflow.cli.{optional}":
                raise


@app.callback()
def _root(device: str = typer.Option("cpu", "--device", metavar="cpu|cuda|cuda:N|auto",
                                     help="where every model of the command computes (fp32 on the CPU, bf16 on "
                                          "CUDA); accepted after any sub-command too, and as $KVFLOW_DEVICE")) -> None:
    """Options common to every command."""


def take_device(argv: list[str]) -> tuple[list[str], str | None]:
    """``--device NAME`` / ``--device=NAME`` wherever it stands (before or after the sub-command) -> (the other
    arguments, NAME); the last one wins."""
    rest, device, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--device":
            if i + 1 >= len(argv):
                raise cx.BadParameter("--device needs a value: cpu, cuda, cuda:N or auto")
            device, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--device="):
            device = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    return rest, device


def main(argv: list[str] | None = None) -> int:
    _register()
    warn_unknown_env()
    try:
        argv, device = take_device(list(sys.argv[1:] if argv is None else argv))
        from kvflow.model import device as devices      # torch is imported by _register already
        if device is not None:
            devices.set_default_device(device)          # one ModelError line for a device torch lacks
        elif os.environ.get(devices.ENV, "").strip():
            devices.resolve(None)                       # a bad $KVFLOW_DEVICE: one line now, not inside a command
        rc = app(args=argv, standalone_mode=False)  # non-standalone click returns typer.Exit's code
        return rc if isinstance(rc, int) else 0
    except KVFlowError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the file system refused (read-only folder, no space, not a directory): one line
        where = f": {err.filename}" if err.filename else ""
        print(f"error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except typer.Exit as ex:
        return ex.exit_code
    except cx.NoArgsIsHelpError as err:  # bare group: help was shown
        print(err.format_message(), file=sys.stderr)
        return 2
    except cx.ClickException as err:
        print(f"error: {err.format_message()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
