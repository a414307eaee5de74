"""GET /metrics: what an operator scrapes to see latency, load and how well speculation works."""

from __future__ import annotations

import httpx

from .conftest import chat_body, metric


def test_metrics_after_some_requests(serve, make_engine):
    with serve(make_engine(num_blocks=128)) as srv:
        for n in (16, 24):
            body = chat_body(max_tokens=n, temperature=0, ignore_eos=True, stream=True)
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
                r.read()
        text = httpx.get(srv.url + "/metrics").text

        assert metric(srv, 'specdec_requests_total{outcome="length"}') == 2
        assert metric(srv, "specdec_generation_tokens_total") == 40
        assert metric(srv, "specdec_prompt_tokens_total") > 0
        assert metric(srv, "specdec_time_to_first_token_seconds_count") == 2
        assert metric(srv, "specdec_inter_token_latency_seconds_count") > 0
        for pool in ("target", "draft"):
            assert metric(srv, f'specdec_kv_blocks{{pool="{pool}",state="used"}}') == 0
            assert metric(srv, f'specdec_kv_blocks{{pool="{pool}",state="free"}}') == 128
        assert metric(srv, "specdec_queue_depth") == 0 and metric(srv, "specdec_running_sequences") == 0
        assert metric(srv, "specdec_engine_up") == 1

        drafted = [metric(srv, f'specdec_draft_tokens_total{{position="{i}"}}') for i in range(1, 5)]
        accepted = [metric(srv, f'specdec_accepted_tokens_total{{position="{i}"}}') for i in range(1, 5)]
        assert drafted[0] > 0 and all(a <= d for a, d in zip(accepted, drafted))
        assert drafted == sorted(drafted, reverse=True) and accepted == sorted(accepted, reverse=True)
        rate = metric(srv, "specdec_acceptance_rate")
        assert abs(rate - sum(accepted) / sum(drafted)) < 1e-9
        assert 1.0 <= metric(srv, "specdec_mean_accepted_length") <= 5.0
        assert "# TYPE specdec_time_to_first_token_seconds histogram" in text


def test_each_app_has_its_own_registry(serve, make_engine):
    with serve(make_engine()) as first, serve(make_engine()) as second:
        httpx.post(first.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 3,
                                                       "ignore_eos": True}, timeout=30)
        assert metric(first, 'specdec_requests_total{outcome="length"}') == 1
        assert metric(second, 'specdec_requests_total{outcome="length"}') == 0


def test_an_moe_target_reports_the_experts_its_windows_read(serve, tiny_parts):
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.testing import from_hf
    from tests.target.moe_models import moe_hf_model

    tokenizer = tiny_parts[2]
    target, draft = (from_hf(moe_hf_model("qwen3_moe", seed, vocab_size=len(tokenizer), num_hidden_layers=layers))
                     for seed, layers in ((0, 3), (1, 1)))
    config = EngineConfig(dtype="float32", num_blocks=128, block_size=8, num_speculative_tokens=3, adaptive_k=False)
    with serve(Engine.from_models(config, target, draft, tokenizer)) as srv:
        body = chat_body(max_tokens=12, temperature=0, ignore_eos=True)
        assert httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert metric(srv, "specdec_moe_verify_windows_total") > 0
        assert 2 <= metric(srv, "specdec_moe_experts_per_window") <= 8  # top 2 of 8
        assert metric(srv, "specdec_moe_experts_per_row") <= 2
        assert metric(srv, 'specdec_moe_experts_by_window_rows{rows="4"}') >= 2
