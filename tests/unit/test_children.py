"""Benchmark child processes (``benchmarks.children``): a child is judged by its outputs, so one
that aborts at exit after writing them is accepted and one that did not write them fails with its
status and the error lines of its log; outputs are written whole or not at all. The children here
are tiny Python scripts, no engine."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tandem.benchmarks.children import ChildFailed, describe_status, log_excerpt, run_child, write_npz

NOISE = "for i in range(500): print(f'INFO engine step {i}', flush=True)\n"


def child(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {"x": z["x"]}


def test_an_engine_child_that_aborts_after_writing_its_outputs_is_accepted(tmp_path, caplog):
    outs = [tmp_path / "a.npz", tmp_path / "b.npz"]
    cmd = child(
        f"""
        import os, sys, numpy as np
        for n, p in enumerate(sys.argv[1:]):
            np.savez_compressed(p, x=np.arange(3) + n)
        {NOISE}
        os.abort()
        """
    )
    with caplog.at_level(logging.WARNING, logger="tandem.benchmarks.children"):
        got = run_child("fake engine", [*cmd, *map(str, outs)], tmp_path / "child.log", outs, load)
    assert [g["x"].tolist() for g in got] == [[0, 1, 2], [1, 2, 3]]
    assert "fake engine exited with status -6 (SIGABRT) after writing its outputs" in caplog.text


def test_an_engine_child_that_exits_without_writing_fails_with_its_status_and_error_lines(tmp_path):
    out = tmp_path / "a.npz"
    cmd = child(
        f"""
        import sys, traceback
        try:
            raise ValueError("no KV cache space")
        except ValueError:
            traceback.print_exc()
        {NOISE}
        sys.exit(1)
        """
    )
    with pytest.raises(ChildFailed) as e:
        run_child("fake engine", cmd, tmp_path / "child.log", [out], load)
    msg = str(e.value)
    assert e.value.returncode == 1 and "fake engine exited with status 1" in msg and str(out) in msg
    assert "Traceback" in msg and "ValueError: no KV cache space" in msg  # far above the last lines
    assert "INFO engine step 499" in msg and "INFO engine step 200" not in msg


def test_an_engine_child_that_aborts_before_writing_every_output_fails_naming_the_signal(tmp_path):
    outs = [tmp_path / "a.npz", tmp_path / "b.npz"]
    cmd = child("import os, sys, numpy as np; np.savez_compressed(sys.argv[1], x=np.arange(3)); os.abort()")
    with pytest.raises(ChildFailed, match=r"status -6 \(SIGABRT\).*b\.npz is missing"):
        run_child("fake engine", [*cmd, str(outs[0])], tmp_path / "child.log", outs, load)


def test_a_truncated_or_stale_output_is_not_taken_for_a_complete_one(tmp_path):
    out, whole = tmp_path / "a.npz", tmp_path / "whole.npz"
    write_npz(whole, {"x": np.arange(100_000)})
    cut = child("import sys; b = open(sys.argv[1], 'rb').read(); open(sys.argv[2], 'wb').write(b[: len(b) // 2])")
    with pytest.raises(ChildFailed, match="status 0"):
        run_child("fake engine", [*cut, str(whole), str(out)], tmp_path / "child.log", [out], load)
    write_npz(out, {"x": np.arange(3)})  # left by an earlier run: removed before the child starts
    with pytest.raises(ChildFailed, match="status 3"):
        run_child("fake engine", child("raise SystemExit(3)"), tmp_path / "child.log", [out], load)


def test_npz_outputs_are_written_whole_or_not_at_all(tmp_path):
    class Unwritable:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("killed while writing")

    out = tmp_path / "a.npz"
    write_npz(out, {"x": np.arange(3)})
    assert load(out)["x"].tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError):
        write_npz(out, {"y": np.arange(4), "x": Unwritable()})  # type: ignore[dict-item]
    assert load(out)["x"].tolist() == [0, 1, 2] and [p.name for p in tmp_path.iterdir()] == ["a.npz"]


def test_exit_statuses_name_their_signal():
    assert describe_status(-6) == "status -6 (SIGABRT)"
    assert describe_status(134) == "status 134 (128 + SIGABRT)"
    assert describe_status(1) == "status 1" and describe_status(0) == "status 0"


def test_log_excerpt_keeps_tracebacks_error_lines_and_the_last_lines_in_order():
    tb = ["Traceback (most recent call last):", '  File "x.py", line 1', "    f()", "RuntimeError: x"]
    text = "\n".join(["INFO a", *tb, *["INFO b"] * 50, "WARNING an Exception in a thread", "INFO c", "end"])
    got = log_excerpt(text, last=2).splitlines()
    assert got == ["[... 1 lines ...]", *tb, "[... 50 lines ...]", "WARNING an Exception in a thread", "INFO c", "end"]
