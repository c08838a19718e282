"""``make run``'s report (``tandem.demo``): its tables and summary fit ``TABLE_COLUMNS`` with the
widest values a run prints, and a streamed reply cut at ``--max-new-tokens`` says so."""

from __future__ import annotations

from tandem.demo import STAGES, TABLE_COLUMNS, cut_note, report, summary
from tandem.stages import SHORT_LABEL_CHARS, Stage
from tandem.streams import ChatResult


def result(mode: str, split_layer: int = 0, **kw) -> ChatResult:
    """A turn with the widest values of a run: long prompts, megabytes sent, seconds of decode."""
    base = dict(
        text="x",
        finish_reason="length",
        prompt_tokens=1536,
        output_tokens=512,
        head_tokens=1536,
        external_tokens=1504,
        split_layer=split_layer,
        output_token_ids=(1, 2, 3),
        timings_ms={st.value: 123456.7 for st in STAGES},
        sent_bytes={"activations": 123_456_789, "kv": 987_654_321, "header": 12_345},
        mode=mode,
        predicted_ttft_ms=98765.4,
        ttft_ms=1234.5,
        mode_reason="auto: whole reply: lowest predicted end-to-end time",
    )
    return ChatResult(**{**base, **kw})


def test_the_report_fits_a_terminal_of_table_columns():
    """The tables were 168 columns wide (the longest stage label is 71 characters)."""
    split = result("split", 4)
    results = {
        "split k=4": split,
        "split turn 2": result("split", 4),
        "plain vLLM": result("direct"),
        "edge only": result("local"),
        "auto": result("remote_prefill"),
    }
    text = report(results) + "\n" + summary(split, results["plain vLLM"], results["edge only"], results["auto"])
    widest = max(text.splitlines(), key=len)
    assert len(widest) <= TABLE_COLUMNS, widest
    assert "123456.7" in text and "987654321" in text and "remote_prefill" in text
    for st in STAGES:
        assert st.short_label in text


def test_every_short_label_is_short_and_names_its_stage_alone():
    labels = [st.short_label for st in Stage]
    assert max(len(label) for label in labels) <= SHORT_LABEL_CHARS
    assert len(set(labels)) == len(labels)


def test_a_reply_cut_at_max_new_tokens_says_so():
    assert cut_note(result("split", 4), 64) == " [cut at 64 tokens: --max-new-tokens]"
    assert cut_note(result("split", 4, finish_reason="stop"), 64) == ""


def test_a_split_dir_that_is_not_one_stops_the_demo_with_one_line(monkeypatch, tmp_path, capsys):
    import pytest

    from tandem.demo import main

    monkeypatch.setattr("sys.argv", ["demo", "--split-dir", str(tmp_path / "split-k6")])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "split-k6 is not a directory" in err and "Traceback" not in err


class _Daemons:
    """``tandem.daemons.Daemons`` without processes: every daemon's wait raises ``fail``, or is ready."""

    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def spawn(self, *args, **kwargs):
        fail = self.fail

        class Ready:
            def wait_ready(self, timeout_s: float) -> int:
                if fail is not None:
                    raise fail
                return 1

        return Ready()


def _run_demo(monkeypatch, tmp_path, fail: BaseException | None, chat=None) -> None:
    import tandem.demo as demo

    split = tmp_path / "split-k4"
    split.mkdir(exist_ok=True)
    monkeypatch.setattr("sys.argv", ["demo", "--split-dir", str(split)])
    monkeypatch.setattr(demo, "Daemons", lambda: _Daemons(fail))
    monkeypatch.setattr(demo, "cloud_command", lambda *a, **kw: [])
    monkeypatch.setattr(demo, "edge_command", lambda *a, **kw: [])
    run = tmp_path / "run"
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda prefix: str(run.mkdir(exist_ok=True) or run))
    if chat is not None:
        monkeypatch.setattr(demo, "chat", chat)
    demo.main()


def test_a_daemon_that_did_not_come_up_stops_the_demo_with_its_message(monkeypatch, tmp_path, capsys):
    import pytest

    from tandem.daemons import DaemonFailed

    with pytest.raises(SystemExit) as e:
        _run_demo(monkeypatch, tmp_path, DaemonFailed("tandem-cloud exited with 1 after 3 s; last lines of x"))
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "tandem: tandem-cloud exited with 1" in err and "logs kept in" in err


def test_an_error_that_is_not_a_daemons_keeps_its_traceback(monkeypatch, tmp_path):
    """Only a daemon's failure is cut to one line: any other error (a fault in the demo or the SDK)
    propagates as it is."""
    import pytest

    def broken(*args):
        raise RuntimeError("a fault past the daemons' start")

    with pytest.raises(RuntimeError, match="a fault past the daemons' start"):
        _run_demo(monkeypatch, tmp_path, None, chat=broken)
