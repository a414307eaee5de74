"""Per-request cost of the Ray Serve path: a 1-token chat request on a tiny engine, one uvicorn server vs
Ray Serve (proxy + ingress + 1 replica), median of 40 sequential requests.  python docs/results/issue27/ray_overhead.py"""
import functools, statistics, time, threading, socket, httpx, uvicorn
from ray import serve
from specdec.api.cluster.app import build_app, ClusterOptions, start_ray, APP_NAME
from specdec.api.server import create_app
from specdec.api.state import ServerSettings
from specdec.testing import tiny_serving_engine

def bench(url, n=40):
    c = httpx.Client(base_url=url, timeout=60, trust_env=False)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": "x"}
    for _ in range(5): c.post("/v1/chat/completions", json=body)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); r = c.post("/v1/chat/completions", json=body); ts.append(time.perf_counter() - t)
        assert r.status_code == 200
    return 1000 * statistics.median(ts)

sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]
server = uvicorn.Server(uvicorn.Config(create_app(tiny_serving_engine(), ServerSettings(model_name="tiny")), log_level="warning"))
threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
time.sleep(3)
single = bench(f"http://127.0.0.1:{port}")
server.should_exit = True; time.sleep(1)
start_ray(None, num_cpus=2, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": 8125})
serve.run(build_app(functools.partial(tiny_serving_engine), ServerSettings(model_name="tiny"), ClusterOptions(replicas=1, replica_cpus=1, log_level="WARNING")), name=APP_NAME, route_prefix="/", blocking=False)
time.sleep(3)
cluster = bench("http://127.0.0.1:8125")
print(f"median request (max_tokens=1, tiny engine): one server {single:.1f} ms, through Ray Serve (proxy + ingress + 1 replica) {cluster:.1f} ms, difference {cluster-single:.1f} ms")
serve.shutdown()
