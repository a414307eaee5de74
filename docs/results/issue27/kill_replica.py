"""Fault drill: after DELAY seconds, kill the engine replica streaming the most requests (as a
crash would: `ray.kill`), and print what the router saw before and after.

    python docs/results/issue27/kill_replica.py [DELAY] [BASE_URL]

Run it beside `specdec bench serve --multi-turn` against `specdec serve --replicas N` on this machine.
"""

import json
import sys
import time
import urllib.request

import ray

from specdec.api.cluster.app import kill_replica

delay = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
base = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8000"


def status() -> dict:
    with urllib.request.urlopen(base + "/cluster") as response:
        return json.load(response)


time.sleep(delay)
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
before = status()
victim = max(before["replicas"], key=lambda r: len(r["active_requests"]))
print(f"killing replica {victim['id']} with {len(victim['active_requests'])} request(s) in flight: "
      f"{victim['active_requests']}", flush=True)
kill_replica(victim["id"])
killed_at = time.monotonic()
while len([r for r in status()["replicas"] if r["id"] != victim["id"]]) < len(before["replicas"]):
    time.sleep(0.5)
after = status()
print(f"replaced after {time.monotonic() - killed_at:.1f}s by {[r['id'] for r in after['replicas']]}")
print(f"retries {before['retries']} -> {after['retries']}, streams cut {before['stream_errors']} -> "
      f"{after['stream_errors']}", flush=True)
