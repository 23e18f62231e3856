"""The live progress line: in place on a terminal, plain periodic lines in a log, the last one kept."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import termios

from qerl_exp.run.progress import Progress

STEP = {"reward": 0.5, "entropy": 1.25, "noise/sigma": 0.01, "perf/rollout_tok_s": 812.4, "loss": 3.0}


def test_plain_lines_in_a_log_first_last_and_interrupted():
    log = io.StringIO()  # not a terminal
    bar = Progress(5, "train", file=log, every_s=3600)
    for step in range(5):
        bar.update(step + 1, {**STEP, "reward": step / 10})
    lines = log.getvalue().splitlines()
    # Only the first and the last step within the interval; the last line carries the last values.
    assert len(lines) == 2, lines
    assert lines[0].startswith("train step 1/5 | reward 0.000 | entropy 1.250 | sigma 0.01 | tok/s 812 | ")
    assert lines[1].startswith("train step 5/5 | reward 0.400 |") and "left" not in lines[1]
    assert "loss" not in log.getvalue()
    bar.close()  # already closed by the last step: nothing more
    assert log.getvalue().splitlines() == lines

    # A run that stops early: closing writes the last state reached, once.
    log = io.StringIO()
    bar = Progress(10, "train", initial=4, file=log, every_s=3600)
    bar.update(5, STEP)
    bar.update(6, {"reward": 0.75})
    bar.close()
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [["train step 5/10", "reward 0.500"], ["train step 6/10", "reward 0.750"]]
    assert "entropy 1.250" in lines[1]  # a value missing from the latest step keeps its last value
    assert re.search(r", ~.+ left$", lines[1])


def test_plain_lines_every_interval():
    log = io.StringIO()
    bar = Progress(3, "eval", unit="seq", fields=(), file=log, every_s=0)
    for _ in range(3):
        bar.advance(1)
    assert [line.split(" | ")[0] for line in log.getvalue().splitlines()] == ["eval seq 1/3", "eval seq 2/3", "eval seq 3/3"]


def test_terminal_bar_updates_in_place_and_keeps_the_final_line():
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    tty = os.fdopen(slave, "w")
    try:
        bar = Progress(4, "train", file=tty)
        for step in range(4):
            bar.update(step + 1, {**STEP, "reward": 0.25 * step})
        tty.flush()
        out = b""
        while select.select([master], [], [], 0.5)[0]:  # drain what the terminal received
            out += os.read(master, 65536)
    finally:
        tty.close()
        os.close(master)
    text = out.decode()
    frames = [f for f in re.split(r"[\r\n]+", text) if f.strip()]
    # Redrawn with carriage returns on one line, not one line per step; ends on the last step.
    assert "\r" in text and text.count("\n") <= 1, repr(text)
    assert "4/4" in frames[-1] and "reward=0.750" in frames[-1] and "sigma=0.01" in frames[-1] and "tok/s=812" in frames[-1]
    assert text.endswith("\n") or text.endswith("\r\n"), "the final line must stay (tqdm leave=True)"
