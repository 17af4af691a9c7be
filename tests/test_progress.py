"""The controller's progress display: a live line (rich) on a terminal, plain lines
elsewhere."""
import io
import json
import sys

from trainmover.control.context import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def metrics_file(tmp_path, steps, step_time=0.5):
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "loss": 3.0 - s / 100, "step_time_s": step_time,
                                "tokens_per_s": 1000.0, "worker": "w1"}) + "\n")
    return str(path)


def test_a_terminal_gets_one_live_line_with_eta_and_standbys(tmp_path, monkeypatch):
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.delenv("TRAINMOVER_PLAIN", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    p = Progress(metrics_file(tmp_path, 10), total_steps=100)
    p.standbys = (1, 2)
    p.poll()
    p.say("a message")
    shown = out.getvalue()
    p.close()
    # 90 steps left at 0.5 s each
    assert "step    10/100" in shown and "ETA 0m45s" in shown
    assert "standbys warm 1/2" in shown and "a message" in shown
    assert "[w1]" not in shown                 # not one plain line per step
    assert "\x1b[" in shown                    # redrawn in place


def test_elsewhere_one_plain_line_per_step(tmp_path, capsys):
    p = Progress(metrics_file(tmp_path, 3), total_steps=3)
    p.poll()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("step     3/3") and lines[-1].endswith("[w1]")
    assert p.eta_s() == 0


def test_a_bench_on_a_terminal_shows_its_run_and_time_left(monkeypatch):
    from trainmover.bench import report

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.delenv("TRAINMOVER_PLAIN", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    clock = iter([100.0, 100.0, 130.0])      # made, first start, second start
    line = report.BenchLine("bench x", 3, clock=lambda: next(clock))
    line.start("cell a")
    line.finish("cell a: 1.0 s")
    line.start("cell b")
    shown = out.getvalue()
    line.close()
    assert "bench x: run 1/3: cell a  (0:00 elapsed)" in shown
    assert "cell a: 1.0 s" in shown
    # one run took 30 s: two left, about a minute
    assert "bench x: run 2/3: cell b  (0:30 elapsed, about 1:00 left)" in shown


def test_a_bench_elsewhere_prints_only_its_results(capsys):
    from trainmover.bench.report import BenchLine

    line = BenchLine("bench x", 2)
    line.start("cell a")
    line.finish("cell a: 1.0 s")
    line.close()
    assert capsys.readouterr().out == "cell a: 1.0 s\n"


def test_a_scripts_model_size_is_shown_once_as_registered(tmp_path, capsys):
    """The launch banner cannot know a script's model: its first record carries the
    registered model's parameter count (worker/loop.py), shown once."""
    from trainmover.control.context import count_text

    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for s in range(3):
            f.write(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.1, "worker": "w0",
                                **({"model_params": 25_165_824, "model_params_of": "the model"}
                                   if s < 2 else {})}) + "\n")
    Progress(str(path), total_steps=3).poll()
    out = capsys.readouterr().out
    assert out.count("parameters") == 1 and "the model: 25.17M parameters" in out, out
    assert [count_text(n) for n in (17, 4_096, 870_000, 1_300_000_000)] == \
        ["17", "4.1K", "0.87M", "1.30B"]
