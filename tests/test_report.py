"""`trainmover report` on a recorded run (DP2xPP2, one planned migration, one crash
recovery): the images are PNGs of the documented size, the HTML embeds them and shows the
interruptions with the downtimes summary.json recorded, and nothing in it points outside
the file; a run without interruptions and bench result files are handled, an unknown bench
file is refused by name."""
import base64
import html
import json
import os
import re
import shutil
import struct

import pytest

from trainmover.core.accounting import downtime_value
from trainmover.view.report import write_report

from mp_harness import set_migration_downtime

DATA = os.path.join(os.path.dirname(__file__), "data", "recorded_run")
# copies of two bench results (benchmarks/results/ at 44cf456): fixtures, so a new bench
# run does not change what these tests read
BENCH = os.path.join(os.path.dirname(__file__), "data")
SIZE = (1000, 450)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, which must come first."""
    assert data[:8] == PNG_SIGNATURE
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def file_png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        return png_size(f.read())


@pytest.fixture
def run_dir(tmp_path):
    # a copy: the report is written under the run dir, and tests/data stays untouched
    dst = tmp_path / "run"
    shutil.copytree(DATA, dst)
    return str(dst)


def rows_of(page: str) -> list[str]:
    return re.findall(r"<tr>.*?</tr>", page)


def test_report_of_recorded_run(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    out = write_report(run_dir)
    assert set(out) == {"html", "timeline", "interruptions"}
    assert os.path.dirname(out["html"]) == os.path.join(run_dir, "report")
    for name in ("timeline", "interruptions"):
        assert os.path.basename(out[name]) == f"{name}.png"
        assert file_png_size(out[name]) == SIZE
    with open(out["html"]) as f:
        page = f.read()

    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(uris) == 2
    for uri in uris:
        assert png_size(base64.b64decode(uri, validate=True)) == SIZE

    for bad in ("http://", "https://", 'src="//', "<link", "<script"):
        assert bad not in page

    # the header: the job as summary.json describes it
    for text in (summary["name"], summary["weights_sha256"], str(summary["steps"]),
                 f"{summary['wall_s']:.3f}", "DP2 x PP2 x TP1"):
        assert text in page

    # one row per interruption, with the downtime summary.json recorded, worded as the demo,
    # status and dashboard word it (core/accounting.py)
    rows = rows_of(page)
    for title, record in (("migration 1", summary["migrations"][0]),
                          ("recovery 1", summary["recoveries"][0])):
        (row,) = [r for r in rows if f"<td>{title}</td>" in r]
        text = downtime_value(record["downtime_s"], record.get("downtime_noise_s"))
        assert f"<td>{html.escape(text)}</td>" in row and text.endswith(" ms"), row
        for seconds in record["phases"].values():
            if seconds >= 0.001 and f"{seconds:.3f}" in row:
                break
        else:
            pytest.fail(f"no phase seconds in {row}")
    (mig,) = [r for r in rows if "<td>migration 1</td>" in r]
    assert "planned" in mig and "state transfer" in mig
    (rec,) = [r for r in rows if "<td>recovery 1</td>" in r]
    assert "crash" in rec and "detection" in rec


@pytest.mark.timeout(60)
def test_a_downtime_inside_the_step_noise_reads_as_such_never_as_a_negative_number(run_dir):
    # a planned migration measured 4 ms below normal steps that varied by 9 ms: the row
    # says so, with the noise beside it
    set_migration_downtime(run_dir, -0.004, 0.009)
    with open(write_report(run_dir)["html"]) as f:
        page = f.read()
    (row,) = [r for r in rows_of(page) if "<td>migration 1</td>" in r]
    assert "<td>no measurable stall (within step noise, ±9.0 ms)</td>" in row, row
    assert "-0.004" not in row and "-4.0" not in row


def test_no_interruptions_still_gives_both_images(run_dir, tmp_path):
    events = os.path.join(run_dir, "events.jsonl")
    with open(events) as f:
        lines = f.readlines()
    kept = [ln for ln in lines
            if json.loads(ln)["event"] not in ("migration_done", "recovery_done")]
    assert len(kept) == len(lines) - 2
    with open(events, "w") as f:
        f.writelines(kept)
    # text from the run is escaped, not taken as markup
    summary = os.path.join(run_dir, "summary.json")
    with open(summary) as f:
        s = json.load(f)
    s["name"] = "<b>demo</b>"
    with open(summary, "w") as f:
        json.dump(s, f)

    out = write_report(run_dir, str(tmp_path / "elsewhere"))
    assert os.path.dirname(out["html"]) == str(tmp_path / "elsewhere")
    assert file_png_size(out["timeline"]) == SIZE
    assert file_png_size(out["interruptions"]) == SIZE
    with open(out["html"]) as f:
        page = f.read()
    assert "migration 1" not in page and "recovery 1" not in page
    assert "&lt;b&gt;demo&lt;/b&gt;" in page and "<b>demo</b>" not in page
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 2


def test_running_job_without_summary(run_dir):
    # a job still running: no summary.json, no end event; the report says so and works
    os.remove(os.path.join(run_dir, "summary.json"))
    events = os.path.join(run_dir, "events.jsonl")
    with open(events) as f:
        lines = [ln for ln in f if json.loads(ln)["event"] != "job_done"]
    with open(events, "w") as f:
        f.writelines(lines)
    out = write_report(run_dir)
    with open(out["html"]) as f:
        page = f.read()
    assert "running" in page and "DP2 x PP2 x TP1" in page
    assert "<td>migration 1</td>" in page


def test_bench_images(run_dir, tmp_path):
    bench = tmp_path / "downtime.json"
    shutil.copy(os.path.join(BENCH, "bench_downtime.json"), bench)
    out = write_report(run_dir, bench=[str(bench)])
    assert os.path.basename(out["bench_downtime"]) == "bench_downtime.png"
    assert file_png_size(out["bench_downtime"]) == SIZE
    # the file has 4 and 8 workers: the scaling chart too
    assert file_png_size(out["scaling_downtime"]) == SIZE
    with open(out["html"]) as f:
        page = f.read()
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 4


def test_unrecognised_bench_file_is_refused_by_name(run_dir, tmp_path):
    # a real result file of another shape (before/after medians), and one that is not JSON
    other = tmp_path / "before-after.json"
    shutil.copy(os.path.join(BENCH, "bench_downtime-before-after.json"), other)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json {")
    for path in (other, garbage):
        with pytest.raises(ValueError, match=re.escape(str(path))):
            write_report(run_dir, bench=[str(path)])
