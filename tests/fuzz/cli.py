"""``python -m tests.fuzz``: property-based fuzzing of the cloud's uplink verification and of raw protobuf messages
into the ``Cloud`` and ``Edge`` gRPC services, for longer than the test suite does (``tests/fuzz/test_fuzz.py`` runs
the same properties, ``tests/fuzz/harness.py``, on fixed seeds).

Everything runs in this process against in-memory engines, head and block store (no model, no GPU): a gateway per
wire format for the ``uplink`` target, and a cloud and an edge gRPC server on loopback for the others. Each target
runs until ``--examples`` cases or its share of ``--seconds``, in rounds of fresh seeds derived from ``--seed``
(random unless given; printed, so a run can be repeated). A failure is printed with its minimal example (Hypothesis
shrinks it) and the target stops; the exit status is 1 when any target failed, or when at the end the servers are
not idle or do not answer good requests with their reference results.

Cases that hit a product bug already known (``harness.KNOWN_BUGS``, each with a strict xfail reproducer in
``tests/fuzz/test_fuzz.py``) are counted and listed but are no failures unless ``--strict``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

from tests.fuzz.harness import KNOWN_BUGS, Harness, describe
from tests.fuzz.strategies import strategy_of
from tests.fuzz.uploads import TARGETS

app = typer.Typer(add_completion=False, help=__doc__)


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The daemons' loggers off the console for the run (a refused turn logs a warning; thousands are expected);
    the ``tandem`` logger's errors still reach the harness's own handler."""
    log = logging.getLogger("tandem")
    level, propagate = log.level, log.propagate
    log.setLevel(logging.ERROR)
    log.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
            yield
    finally:
        log.setLevel(level)
        log.propagate = propagate


def failure_text(e: BaseException) -> str:
    """A failure as Hypothesis reports it: each distinct error with its minimal (shrunk) example."""
    parts = []
    for x in getattr(e, "exceptions", None) or [e]:
        notes = "\n".join(getattr(x, "__notes__", []))
        parts.append(f"{type(x).__name__}: {x}\n{notes}".rstrip())
    return "\n\n".join(parts)


def run_round(harness: Harness, target: str, n: int, seed: int, verbose: bool) -> BaseException | None:
    """Up to ``n`` cases of ``target`` from ``seed``; the failure (after shrinking), or None."""

    @hypothesis_seed(seed)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.generate, Phase.shrink),
        verbosity=Verbosity.verbose if verbose else Verbosity.normal,  # normal: the failing example is reported
    )
    @given(strategy_of(target))
    def prop(case: Any) -> None:
        harness.check(target, case)

    try:
        prop()
    except Exception as e:  # a broken property (Hypothesis re-raises it after shrinking)
        return e
    return None


def run_target(
    harness: Harness, target: str, examples: int, seconds: float, seed: int, verbose: bool
) -> BaseException | None:
    """Rounds of ``target`` until ``examples`` cases or ``seconds``; the first failure, or None."""
    stats = harness.stats[target]
    t_end = time.monotonic() + seconds
    batch, rnd = 25, 0
    while stats.cases < examples and time.monotonic() < t_end:
        t0, before = time.monotonic(), stats.cases
        failure = run_round(harness, target, min(batch, examples - stats.cases), seed + 7919 * rnd, verbose)
        if failure is not None:
            return failure
        rnd += 1
        per_case = (time.monotonic() - t0) / max(1, stats.cases - before)
        batch = max(10, min(2000, int(min(10.0, t_end - time.monotonic()) / max(per_case, 1e-4))))
    return None


@app.command()
def main(
    examples: Annotated[int, typer.Option(help="cases per target (at most)")] = 5000,
    seconds: Annotated[float, typer.Option(help="wall-clock budget of the whole run, split among the targets")] = 300,
    target: Annotated[
        list[str] | None, typer.Option(help=f"a target to run (repeat the option); default all of {TARGETS}")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="random seed (default: a random one, printed)")] = None,
    strict: Annotated[bool, typer.Option(help="a case that hits a known product bug fails too")] = False,
    hang_s: Annotated[float, typer.Option(help="a case running longer than this is a hang")] = 30.0,
    verbose: Annotated[bool, typer.Option(help="print every case Hypothesis tries")] = False,
) -> None:
    """Fuzz the targets; print cases and outcomes per target, failures with their minimal examples, and the
    known product bugs hit. Exit 1 on any failure."""
    targets = list(target or TARGETS)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise typer.BadParameter(f"unknown target(s) {unknown}; choose from {TARGETS}", param_hint="--target")
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    print(f"tests.fuzz: seed {seed} (repeat with --seed {seed}); targets {', '.join(targets)}")
    print(f"up to {examples} cases per target, {seconds:.0f} s in all", flush=True)
    failures: dict[str, str] = {}
    with quiet_logs():
        harness = Harness(hang_s=hang_s, strict=strict)
        try:
            for i, t in enumerate(targets):
                t0 = time.monotonic()
                failure = run_target(harness, t, examples, seconds / len(targets), seed + 104_729 * i, verbose)
                s = harness.stats[t]
                print(f"{t}: {s.cases} cases in {time.monotonic() - t0:.1f} s, {'FAILED' if failure else 'ok'}")
                if failure is not None:
                    failures[t] = failure_text(failure)
                    print(f"--- {t} failed; minimal example:\n{failures[t]}\n---", flush=True)
            try:
                harness.final_check()
            except Exception as e:
                failures["final check"] = failure_text(e)
                print(f"--- final check failed: {failures['final check']}")
        finally:
            harness.close()
    print("\ncases and outcomes per target:")
    print(describe(harness.stats))
    hit = {k for s in harness.stats.values() for k in s.known}
    if hit:
        print(
            "\nknown product bugs hit" + (" (failures: --strict)" if strict else " (no failures; --strict makes them)")
        )
        for k in sorted(hit):
            bug = KNOWN_BUGS[k]
            print(f"  {k}: {bug.summary}\n    where: {bug.where}")
    if failures:
        print(f"\nFAILED: {', '.join(failures)} (seed {seed})", file=sys.stderr)
        raise typer.Exit(1)
    print(f"\nno failures (seed {seed})")
