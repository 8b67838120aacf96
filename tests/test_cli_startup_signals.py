"""A stop signal while `amsp` is still importing (before main() runs) ends it in one line,
by the signal itself (the status a shell or torchrun agent reads is unchanged), no trace."""

import signal
import subprocess
import sys

import pytest

START = ("import os, signal, sys; import amsp_planner.cli.main as m; "
         "os.kill(os.getpid(), signal.{sig}); print('survived')")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_during_startup_is_one_line_and_ends_by_that_signal(sig):
    p = subprocess.run([sys.executable, "-c", START.format(sig=sig)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == -getattr(signal, sig), (p.returncode, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"interrupted: {sig}"), p.stderr
    assert "Traceback" not in p.stderr


def test_main_hands_the_signals_back_to_python_and_the_commands():
    code = ("import signal; import amsp_planner.cli.main as m; m._hand_over_signals(); "
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
            "signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "
            "signal.getsignal(signal.SIGHUP) == signal.SIG_DFL)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["True", "True", "True"], p.stderr


def test_ctrl_c_in_a_command_is_still_the_one_interrupted_line():
    # after the hand-over, Ctrl-C inside a command reaches main()'s KeyboardInterrupt line
    code = ("import os, signal, sys; import amsp_planner.cli.main as m; import click\n"
            "@click.command('selfint')\n"
            "def selfint():\n    os.kill(os.getpid(), signal.SIGINT)\n"
            "m.LazyGroup.COMMANDS['selfint'] = ('__main__', 'selfint')\n"
            "m.main(['selfint'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130 and p.stderr.strip() == "interrupted: SIGINT (Ctrl-C)", (p.returncode, p.stderr)
