"""`ctxpar bench serve`: a real server process under a small concurrency sweep.

The served greedy tokens are checked against offline LLM.generate by the
benchmark itself (its "identical" column); here every request must match.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_sweep_prints_each_level_and_the_ratios(tiny_model_dirs):
    argv = [
        "bench",
        "serve",
        "--model",
        str(tiny_model_dirs["llama"]),
        "--concurrency",
        "1",
        "3",
        "--num-prompts",
        "5",
        "--output-len",
        "4",
        "--max-prompt-len",
        "96",
        "--threads",
        "1",
    ]
    r = subprocess.run([sys.executable, "-m", "ctxpar.cli", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # C, the budget ("serve": the server's default), req/s, out tok/s, ..., identical/N
    level = r"^ ?(\d+) +serve +([\d.]+) +([\d.]+) .* (\d+)/(\d+)$"
    rows = {int(m[1]): m for m in re.finditer(level, r.stdout, re.M)}
    assert sorted(rows) == [1, 3], r.stdout
    for m in rows.values():
        assert float(m[2]) > 0 and float(m[3]) > 0
        assert m[4] == m[5] == "5", r.stdout  # every request token-identical to offline
    assert re.search(r"throughput served\(C=\d\)/offline [\d.]+x, TTFT p50 offline/served\(C=1\) [\d.]+x", r.stdout)


def test_only_loopback_urls(capsys):
    from ctxpar import cli

    assert cli.main(["bench", "serve", "--url", "http://example.com:8000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --url must be an http:// loopback address") and "example.com" in err


def test_guidellm_needs_a_peer(capsys):
    from ctxpar import cli

    assert cli.main(["bench", "serve", "--guidellm-venv", "/nowhere"]) == 2
    assert "--guidellm-venv runs beside --peer-python" in capsys.readouterr().err


def test_level_figures_from_stream_timings():
    """Five requests; the fifth ends after the measured 2 s window and is left out. TTFTs of
    the four inside 0.1-0.4 s; request i's gaps 10 and 10 (2i + 1) ms, its ITL their mean,
    10 (i + 1) ms (the p50 of every gap would be 10 ms)."""
    from ctxpar.bench.serve_peer import summarize
    from ctxpar.bench.server_process import Timing

    timings = []
    for i in range(4):
        first = 1.1 + 0.1 * i
        timings.append(Timing(sent=1.0, arrivals=[first, first + 0.01, first + 0.01 + 0.01 * (2 * i + 1)]))
    timings.append(Timing(sent=2.5, arrivals=[2.9, 3.1]))  # in the cool-down
    f = summarize(timings, start=1.0, end=3.0)
    assert f.requests == 4 and f.req_s == 2.0
    # numpy's linear percentile of 100, 200, 300, 400 ms: p50 midway between 200 and 300, p90 at 370
    assert abs(f.ttft_p50_ms - 250) < 1e-6 and abs(f.ttft_p90_ms - 370) < 1e-6
    assert abs(f.itl_p50_ms - 25) < 1e-6  # the requests' 10, 20, 30, 40 ms
    assert summarize(timings, start=5.0, end=6.0) is None  # none ended inside: the level is not measured


def test_level_figures_from_a_guidellm_report():
    """guidellm's report layout (guidellm 0.8.1's JSON output, trimmed to the fields read):
    requests/s is its own rate of the requests that ended in its measured window."""
    from ctxpar.bench.serve_peer import guidellm_figures, ratio_line

    dist = lambda p50, p90: {"successful": {"median": p50, "percentiles": {"p50": p50, "p90": p90}}}
    metrics = {
        "request_totals": {"successful": 40, "errored": 0, "incomplete": 0},  # the cool-down's too
        "requests_per_second": {"successful": {"mean": 0.5}},
        "time_to_first_token_ms": dist(400.0, 900.0),
        "inter_token_latency_ms": dist(20.0, 35.0),
    }
    f = guidellm_figures({"benchmarks": [{"duration": 64.0, "metrics": metrics}]})
    assert (f.requests, f.req_s, f.ttft_p50_ms, f.ttft_p90_ms, f.itl_p50_ms) == (32, 0.5, 400.0, 900.0, 20.0)
    half = type(f)(32, 0.25, 800.0, 1800.0, 40.0)
    assert ratio_line(f, half) == "req/s 2.00x, TTFT p50 0.50x, p90 0.50x, ITL p50 0.50x"


def test_a_timed_level_cycles_its_prompts_until_its_seconds():
    """A real HTTP server streaming three events a request, 50 ms apart: two clients for
    1 s send the two bodies in turn, well over two requests, and stop taking new ones."""
    import http.server
    import threading
    import time

    from ctxpar.bench.server_process import sweep_level

    seen: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["prompt"][0])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in range(3):
                time.sleep(0.05)
                self.wfile.write(f'data: {{"choices": [{{"token_ids": [{t}]}}]}}\n\n'.encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bodies = [{"prompt": [7]}, {"prompt": [8]}]
        t_start = time.perf_counter()
        timings, t0 = sweep_level("127.0.0.1", server.server_address[1], bodies, 2, time.monotonic() + 30, seconds=1)
        took = time.perf_counter() - t0
    finally:
        server.shutdown()
    assert t_start <= t0 and 1.0 <= took < 1.5  # the requests in flight at 1 s end, no new ones start
    assert 8 <= len(timings) == len(seen) <= 14  # ~150 ms a request, two at a time
    assert seen[:2] in ([7, 8], [8, 7]) and set(seen) == {7, 8} and abs(seen.count(7) - seen.count(8)) <= 2
    assert all(t.token_ids == [0, 1, 2] for t in timings)
