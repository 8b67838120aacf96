"""amsp: plan, price and run ZeRO-style sharding for LLM training.

    amsp compare --model llama-7b --gpus 1024
"""

from __future__ import annotations

import _signal  # the C module: installs the handlers before `signal`'s enums are built
import os
import sys

_STOPS = {s: name for s, name in ((_signal.SIGINT, "SIGINT (Ctrl-C)"),
                                   (_signal.SIGTERM, "SIGTERM"),
                                   (getattr(_signal, "SIGHUP", None), "SIGHUP")) if s is not None}


def _stopped_while_starting(signum, frame) -> None:
    """A stop signal while amsp is still importing: one line, then the signal's own default
    end (the exit status a shell or torchrun agent reads stays 128 + the signal). Nothing is
    written before ``main`` runs, so nothing is left to clean up."""
    sys.stderr.write(f"interrupted: {_STOPS[signum]} while amsp was starting; nothing was "
                     "written\n")
    sys.stderr.flush()
    _signal.signal(signum, _signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _as_command() -> bool:
    """Whether this import starts the `amsp` command (its console script, or ``python -m
    amsp_planner.cli.main``), not a library's or a test's import of the module."""
    return __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "amsp"


if _as_command():  # from here until main() hands over to the commands' own handling
    for _s in _STOPS:
        try:
            if _signal.getsignal(_s) in (_signal.SIG_DFL, _signal.default_int_handler):
                _signal.signal(_s, _stopped_while_starting)
        except ValueError:  # not the main thread: signals are not this import's to take
            break

import click  # noqa: E402

from amsp_planner import __version__  # noqa: E402


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs (keeps `amsp` fast)."""

    COMMANDS = {
        "calibrate": ("amsp_planner.cli.calibrate", "calibrate"),
        "compare": ("amsp_planner.cli.compare", "compare"),
        "plan": ("amsp_planner.cli.plan", "plan"),
        "explain": ("amsp_planner.cli.explain", "explain"),
        "export": ("amsp_planner.cli.export", "export"),
        "validate": ("amsp_planner.cli.plan_tools", "validate"),
        "schema": ("amsp_planner.cli.plan_tools", "schema"),
        "specs": ("amsp_planner.cli.specs_cmd", "specs"),
        "train": ("amsp_planner.cli.train", "train"),
        "whatif": ("amsp_planner.cli.whatif", "whatif"),
    }

    def list_commands(self, ctx):
        return sorted(self.COMMANDS)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand as e:  # suggest among the lazy names
            name = click.utils.make_str(args[0])
            raise click.exceptions.NoSuchCommand(name, possibilities=list(self.COMMANDS),
                                                 ctx=ctx) from e

    def get_command(self, ctx, name):
        if name not in self.COMMANDS:
            return None
        import importlib

        mod, attr = self.COMMANDS[name]
        return getattr(importlib.import_module(mod), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="amsp")
def cli():
    """Plan, price and run ZeRO-style sharding (P, G, OS) for LLM training."""


def _hand_over_signals() -> None:
    """Back to Python's own handling: Ctrl-C raises KeyboardInterrupt (one line below), SIGTERM
    and SIGHUP end the process at once (a rank in a collective must die on them); the commands
    that need more install their own (train, calibrate, whatif)."""
    for s in _STOPS:  # (a handler is only ever set from the main thread, above)
        if _signal.getsignal(s) is _stopped_while_starting:
            _signal.signal(s, _signal.default_int_handler if s == _signal.SIGINT
                           else _signal.SIG_DFL)


def _stdout_failed(e: OSError) -> bool:
    """Whether the OSError is a failed write of the output: no file named (amsp's own files
    are written with their names in their errors), and an errno of a write (the buffer of a
    failed write is gone, so flushing again cannot tell)."""
    import errno

    return e.filename is None and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
                                              errno.EPIPE, errno.EIO)


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is left in its buffer would fail again at exit."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2 (infeasible: 3),
    cut to a readable length (``errors.readable``)."""
    # pydantic scans every installed distribution's entry points for its plugins when the
    # first model class is made (about 30 ms of a cold `amsp plan`); the specs use none.
    # A user's own setting of the variable stands.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from amsp_planner.cli import notes
    from amsp_planner.errors import AmspUserError, InfeasibleError, readable

    _hand_over_signals()

    try:
        try:
            rv = cli.main(args=argv, prog_name="amsp", standalone_mode=False)
        except BaseException:
            notes.drop()  # refused, infeasible or stopped: its one line alone
            raise
        notes.flush()
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.ClickException as e:
        msg = readable(e.format_message())
        hint = ""
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            hint = f" (see '{ctx.command_path} --help')"
        click.echo(f"error: {msg}{hint}", err=True)
        sys.exit(2)
    except AmspUserError as e:
        click.echo(f"error: {readable(e)}", err=True)
        sys.exit(2)
    except InfeasibleError as e:
        click.echo(f"infeasible: {readable(e)}", err=True)
        sys.exit(3)
    except OSError as e:  # a fault no command named: writing the output (a full disk), or other
        if _stdout_failed(e):
            _drop_stdout()
            click.echo(f"error: cannot write the output: {e.strerror or e}", err=True)
        else:
            at = f": {e.filename}" if e.filename else ""
            click.echo(f"error: {e.strerror or e}{at}", err=True)
        sys.exit(1)
    except (click.exceptions.Abort, KeyboardInterrupt) as e:  # click: Ctrl-C and EOF -> Abort
        if isinstance(e.__cause__ or e.__context__, EOFError):
            click.echo("aborted: end of input", err=True)
            sys.exit(1)
        click.echo("interrupted: SIGINT (Ctrl-C)", err=True)
        sys.exit(130)
    if isinstance(rv, int):
        sys.exit(rv)


if __name__ == "__main__":
    main()
