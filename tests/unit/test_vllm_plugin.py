"""tandem's vLLM general plugin (cloud/engines/vllm_plugin.py): installed as an entry point, it sets how long
an idle vLLM worker busy-polls, and ends vLLM's spawned processes without the interpreter's
teardown, only when tandem-cloud asks for it. Each case runs in a fresh
interpreter, as vLLM's engine processes do; the one in-process test undoes what it changes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "import inspect\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
    "print(inspect.signature(SpinCondition.__init__).parameters['busy_loop_s'].default)\n"
)


def _default_after_plugins(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_VLLM_WORKER_BUSY_POLL_S"}
    if env_value is not None:
        env["TANDEM_VLLM_WORKER_BUSY_POLL_S"] = env_value
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(("env_value", "want"), [("0.01", "0.01"), (None, "1")])
def test_vllm_loads_the_plugin_which_sets_the_worker_polling_only_when_asked(env_value, want):
    assert _default_after_plugins(env_value) == want


def test_a_vllm_the_plugin_does_not_fit_still_starts(monkeypatch, caplog):
    from tandem.cloud.engines import vllm_plugin

    def broken(busy_s):
        raise ImportError("no shm_broadcast in this vLLM")

    monkeypatch.setattr(vllm_plugin, "set_worker_busy_poll_s", broken)
    monkeypatch.setenv(vllm_plugin.ENV, "0.01")
    vllm_plugin.register()  # does not raise
    assert "left as is" in caplog.text


@pytest.mark.parametrize(("env_value", "applied"), [("0.5", [0.5]), ("0", [0.0]), ("soon", []), ("-1", [])])
def test_the_plugin_applies_only_a_number_of_seconds(monkeypatch, env_value, applied):
    from tandem.cloud.engines import vllm_plugin

    seen: list[float] = []
    monkeypatch.setattr(vllm_plugin, "set_worker_busy_poll_s", seen.append)
    monkeypatch.setenv(vllm_plugin.ENV, env_value)
    vllm_plugin.register()
    assert seen == applied


def test_the_cloud_passes_its_setting_to_the_engine_processes(monkeypatch):
    """``start_engine`` exports the setting, and asks for the fast exit, before vLLM spawns the engine
    core and its worker."""
    # start_engine writes os.environ and builds vLLM's engine args, which load vLLM's plugins in this
    # process: undo all three afterwards (setenv first, so that the variable is restored even when
    # it was unset)
    from vllm import plugins
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from tandem.cloud.config import CloudConfig, EngineConfig
    from tandem.cloud.engines import vllm_plugin

    monkeypatch.setenv(vllm_plugin.ENV, "unset")
    monkeypatch.setenv(vllm_plugin.FAST_EXIT_ENV, "unset")
    monkeypatch.setattr(SpinCondition.__init__, "__defaults__", SpinCondition.__init__.__defaults__)
    monkeypatch.setattr(plugins, "plugins_loaded", plugins.plugins_loaded)
    calls = []

    class Stop(Exception):
        pass

    def from_engine_args(args, **kw):
        calls.append((os.environ.get(vllm_plugin.ENV), os.environ.get(vllm_plugin.FAST_EXIT_ENV)))
        raise Stop

    monkeypatch.setattr("vllm.v1.engine.async_llm.AsyncLLM.from_engine_args", from_engine_args)
    from tandem.cloud.engines.start import start_engine
    from tandem.cloud.engines.vllm_engines import DECODE

    cfg = CloudConfig(engine=EngineConfig(worker_busy_poll_s=0.25))
    with pytest.raises(Stop):
        start_engine(cfg.split_dir, cfg, DECODE, "kv_consumer", 0)
    assert calls == [("0.25", "1")]


class _WritesWhenFinalized:
    """Writes its file in ``__del__``: at the interpreter's teardown when kept in a module global."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.open = open  # the builtins are gone by then

    def __del__(self) -> None:
        with self.open(self.path, "w") as f:
            f.write("finalized")


_KEPT: list = []


def _child(marker_dir: str, fast_exit_env: str | None, code: int) -> None:
    """A spawned process as vLLM's are: the plugin is registered the way vLLM loads it."""
    import atexit
    from multiprocessing import spawn
    from pathlib import Path

    from tandem.cloud.engines import vllm_plugin

    os.environ.pop(vllm_plugin.ENV, None)
    os.environ.pop(vllm_plugin.FAST_EXIT_ENV, None)
    if fast_exit_env is not None:
        os.environ[vllm_plugin.FAST_EXIT_ENV] = fast_exit_env
    vllm_plugin.register()
    (Path(marker_dir) / "installed").write_text(str(spawn.sys is not sys))
    # an atexit handler's output comes after _bootstrap flushed: only the exit's own flush sends it
    atexit.register(lambda: print("printed at exit", end="", flush=False))
    atexit.register(lambda: (Path(marker_dir) / "atexit").write_text("ran"))
    _KEPT.append(_WritesWhenFinalized(str(Path(marker_dir) / "finalized")))
    sys.exit(code)


@pytest.mark.parametrize(("fast_exit_env", "fast"), [("1", True), (None, False), ("0", False)])
def test_a_spawned_process_with_fast_exit_skips_only_the_interpreter_teardown(
    tmp_path, capfd, monkeypatch, fast_exit_env, fast
):
    """With ``TANDEM_VLLM_FAST_EXIT=1`` the plugin makes a spawned process skip the interpreter's
    teardown (here: a module global's ``__del__``); its exit code, ``atexit`` handlers and their
    buffered output stay. Without it (the control cases) nothing changes and the teardown runs."""
    import multiprocessing

    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the child's stdout is buffered, as a daemon's is
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_child, args=(str(tmp_path), fast_exit_env, 3))
    p.start()
    p.join(120)
    assert p.exitcode == 3
    assert (tmp_path / "installed").read_text() == str(fast)
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "finalized").exists() is not fast
    assert "printed at exit" in capfd.readouterr().out


def test_fast_exit_changes_nothing_in_a_process_multiprocessing_did_not_start():
    from multiprocessing import spawn

    from tandem.cloud.engines import vllm_plugin

    assert not vllm_plugin.install_fast_exit()
    assert spawn.sys is sys
