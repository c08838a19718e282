"""``python -m tests.fuzz``: the fuzzing CLI (``tests/fuzz/cli.py``); ``make fuzz`` runs it for 300 s."""

from tests.fuzz.cli import app

app(prog_name="python -m tests.fuzz")
