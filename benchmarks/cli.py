"""``tandem-bench``: every benchmark behind one command, one subcommand each (``tandem-bench capacity
--model-dir DIR``), as ``vllm bench`` is. A subcommand is its module's Typer command with that module's
flags (``tandem-bench SUB --help``), its module imported only when the subcommand is looked up: a run
imports its own benchmark alone; ``tandem-bench --help`` lists them all (importing each) with
``BENCHMARKS``' summaries. What each measures, and its results: docs/benchmarks.md."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperGroup


@dataclass(frozen=True)
class Benchmark:
    module: str  # under tandem.benchmarks, holding the Typer ``app`` of one command
    summary: str  # one line for ``tandem-bench --help``


BENCHMARKS: dict[str, Benchmark] = {
    "modes": Benchmark("bench", "TTFT, ITL and bytes of every mode (split, cloud-only, edge-only, ...) over links"),
    "capacity": Benchmark("capacity", "goodput within a TTFT SLO under Poisson load, per mode"),
    "burst": Benchmark("burst", "two edges on one cloud, one flooding it: the quiet one's SLO"),
    "fidelity": Benchmark("fidelity", "each wire format pair's next-token KL and flips against the noise floor"),
    "exactness": Benchmark("exactness", "remote prefill's greedy replies against direct and local mode's"),
    "multiturn": Benchmark("multiturn", "bytes on the uplink over multi-turn chats: delta-KV against a resend"),
    "batching": Benchmark("batching", "the cloud engine's continuous batching against max_num_seqs"),
    "edge": Benchmark("edge_decode", "the edge's decode runtimes (ONNX Runtime, GenAI, vLLM) on one checkpoint"),
    "edge-engine": Benchmark("edge_engine", "the local engine's own cost per decode step, over an in-memory model"),
    "head": Benchmark("edge_head", "the split head's prefill: tandem's torch.onnx export against the model builder's"),
}


class BenchmarkGroup(TyperGroup):
    """The subcommands of ``BENCHMARKS``, each module imported when its subcommand is looked up (to
    run, for its help, or for the list of ``tandem-bench --help``)."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(BENCHMARKS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        bench = BENCHMARKS.get(cmd_name)
        if bench is None:
            return None
        command = typer.main.get_command(importlib.import_module(f"tandem.benchmarks.{bench.module}").app)
        command.name = cmd_name  # the usage line reads "tandem-bench NAME"
        command.short_help = bench.summary
        return command


app = typer.Typer(cls=BenchmarkGroup, name="tandem-bench", no_args_is_help=True, add_completion=False)


@app.callback()
def benchmarks() -> None:
    """Every benchmark of tandem, one subcommand each: `tandem-bench SUB --help` gives its flags;
    docs/benchmarks.md what each measures and its results."""
