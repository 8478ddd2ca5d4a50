"""Progress lines degrade to plain lines off a terminal; status.json round-trips."""
import io

from raypar.driver.progress import Progress, format_eta, format_status, read_status, write_status


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(total_steps=5, every=2, stream=out)
    for step in range(5):
        p.step(step, loss=1.0, tokens_per_s=100.0, step_time_s=2.0, lr=1e-3, grad_norm=0.5)
    lines = out.getvalue().splitlines()
    assert [l.split()[1] for l in lines] == ["1/5", "3/5", "5/5"]
    assert "\r" not in out.getvalue() and lines[0].endswith("eta 0:08")


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_live_line_on_a_terminal():
    out = Tty()
    p = Progress(total_steps=3, stream=out)
    for step in range(3):
        p.step(step, loss=1.0, tokens_per_s=100.0, step_time_s=1.0, lr=1e-3, grad_norm=0.5)
    assert out.getvalue().count("\r") == 3 and out.getvalue().endswith("eta 0:00\n")


def test_eta_and_status(tmp_path):
    assert format_eta(3725) == "1:02:05" and format_eta(65) == "1:05"
    write_status(tmp_path, state="RUNNING", grid="dp=1 x pp=2 x ep=1", step=3, total_steps=10)
    status = read_status(tmp_path)
    assert status["state"] == "RUNNING" and "RUNNING" in format_status(status)
