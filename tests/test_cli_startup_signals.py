"""A stop signal while `amsp` is still importing (before main() runs) ends it in one line,
by the signal itself (the status a shell or torchrun agent reads is unchanged), no trace."""

import signal
import subprocess
import sys

import pytest

# sys.argv[0] as the console script sets it: the import starts the `amsp` command
START = ("import os, signal, sys; sys.argv[0] = '/usr/bin/amsp'; "
         "import amsp_planner.cli.main as m; os.kill(os.getpid(), signal.{sig}); "
         "print('survived')")


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
    code = ("import signal, sys; sys.argv[0] = 'amsp'; import amsp_planner.cli.main as m; "
            "m._hand_over_signals(); "
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


def test_a_library_import_leaves_the_signals_alone():
    # a REPL, a test runner or another program importing the module keeps its own Ctrl-C
    code = ("import os, signal, time\nimport amsp_planner.cli.main\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "except KeyboardInterrupt:\n    print('KeyboardInterrupt')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "KeyboardInterrupt" and p.returncode == 0, p.stderr
    # and an import from another thread does not fail
    code = ("import sys, threading\nsys.argv[0] = 'amsp'\nout = []\n"
            "t = threading.Thread(target=lambda: out.append(__import__('amsp_planner.cli.main')))\n"
            "t.start(); t.join(); print(bool(out))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "True", p.stderr
