"""`specdec serve --replicas N` as a user runs it: a subprocess that starts a local Ray, deploys tiny
replicas from disk, serves, and stops on SIGTERM; bad flags and models fail clearly."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from specdec.api.cli import build_parser, main
from specdec.testing import write_tiny_pair

from .test_serve_cmd import _finish, _serve

pytest.importorskip("ray.serve", reason="the replica tests need Ray Serve: pip install -e '.[cluster]'")


def test_replica_flags_parse_and_bad_ones_are_refused(capsys):
    args = build_parser().parse_args(["serve", "--replicas", "3", "--router", "round-robin", "--ray-address", "auto",
                                      "--router-min-match", "0.25", "--route-timeout", "30"])
    assert (args.replicas, args.router, args.ray_address, args.router_min_match, args.route_timeout) == (
        3, "round-robin", "auto", 0.25, 30.0)
    assert build_parser().parse_args(["serve"]).replicas is None  # one engine in this process, no Ray
    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--route-timeout", "0"]) == 2
    assert "--route-timeout" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--replicas", "3", "--prefill-replicas", "1", "--kv-lease-timeout", "5"])
    assert (args.prefill_replicas, args.kv_lease_timeout, args.kv_pull_timeout) == (1, 5.0, 30.0)
    assert main(["serve", "--replicas", "2", "--prefill-replicas", "2"]) == 2
    assert "at least one decode replica" in capsys.readouterr().err
    assert (args.decode_steps, args.prefill_nice) == ("steady", 10)  # decode replicas' defaults under PD
    assert build_parser().parse_args(["serve", "--decode-steps", "adaptive"]).decode_steps == "adaptive"
    assert main(["serve", "--replicas", "2", "--prefill-replicas", "1", "--prefill-nice", "25"]) == 2
    assert "--prefill-nice must be in 0..19" in capsys.readouterr().err
    assert main(["serve", "--prefill-replicas", "1"]) == 2
    assert "needs --replicas" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_replicas_end_to_end(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    proc, url = _serve("--replicas", "2", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
                       "--no-warmup", "--served-model-name", "tiny")
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "never healthy"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert len(httpx.get(url + "/cluster").json()["replicas"]) == 2
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        with pytest.raises(httpx.HTTPError):  # Ray Serve's proxy went with it
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_serve_replicas_exits_1_naming_why_the_replicas_cannot_load(tmp_path):
    # Ray Serve retries a failing constructor 3 times a replica by default; once is enough to
    # show that the deploy fails and why (and saves CI half a minute)
    proc, _ = _serve("--replicas", "2", "--target", str(tmp_path / "missing"), "--no-speculation",
                     env={"RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"})
    output = _finish(proc, 180)
    assert proc.returncode == 1, output
    assert "deploying the replicas failed" in output and "missing" in output.split("deploying the replicas failed")[1]


def test_without_replicas_ray_is_not_imported():
    import subprocess
    import sys

    code = ("import sys; from specdec.api.cli import build_parser; from specdec.api import serve_cmd; "
            "build_parser().parse_args(['serve', '--port', '1']); assert 'ray' not in sys.modules, 'ray imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


@pytest.mark.slow
def test_sigterm_while_the_replicas_deploy_shuts_down_cleanly(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    proc, url = _serve("--replicas", "2", "--target", str(target), "--draft", str(draft), "--dtype", "float32")
    try:
        deadline = time.monotonic() + 120
        while True:  # Ray Serve's proxy answers (404 / 503) before the app is up
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
