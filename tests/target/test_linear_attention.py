"""Hybrid models (issue 61): Qwen3-Next's Gated DeltaNet layers beside full attention give
transformers' logits through our runner, prompt fed whole or in chunks, several sequences in one
forward; a verify window's rejected rows are dropped by starting from the state of the last kept
row (`cache.state_cache`), so decoding after a rollback is transformers' on the kept tokens."""

import pytest
import torch

from specdec.cache import RecurrentStateCache, StateSpec
from specdec.target import linear_attention
from specdec.target.config import ModelConfig
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.hybrid_models import FAMILIES, hybrid_hf_model

PROMPT = [5, 17, 33, 8, 61, 9, 42, 11, 70, 3, 25]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def _runner(hf, depth: int = 6, block_size: int = 4) -> ModelRunner:
    return ModelRunner.build(from_hf(hf), block_size=block_size, num_blocks=64, state_slots=4, state_depth=depth)


def _feed(runner, table, ids, num_logits=None):
    table.ensure_slots(table.num_computed + len(ids))
    return runner.forward([Window(table, ids, len(ids) if num_logits is None else num_logits)])


def test_config_reads_the_hybrid_layers():
    cfg = ModelConfig.from_hf(hybrid_hf_model("moe").config)
    assert cfg.linear.layers == (0, 1, 2) and cfg.is_linear_layer(2) and not cfg.is_linear_layer(3)
    assert cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 8
    assert cfg.offset_norms and cfg.attn_output_gate and cfg.qk_norm and cfg.rotary_dim == 4
    assert cfg.moe.num_experts == 4 and cfg.moe.shared_expert_size == 32
    assert ModelConfig.from_hf(hybrid_hf_model("dense").config).moe is None
    q35 = ModelConfig.from_hf(hybrid_hf_model("qwen3.5-moe").config)
    assert q35.linear.split_projections and not cfg.linear.split_projections
    assert q35.moe.norm_topk and q35.moe.shared_expert_size == 32 and q35.rotary_dim == 4
    assert "linear attention" in cfg.c_loop_differences() and cfg.unquantized_reason() is not None


@pytest.fixture(params=["c", "torch"])
def recurrence(request, monkeypatch):
    """The layers' recurrence in C (`linear_attention.c`) or in torch (where no kernel runs)."""
    if request.param == "torch":
        monkeypatch.setattr(linear_attention, "load_kernel", lambda level=None: None)
    elif linear_attention.load_kernel() is None:
        pytest.skip(f"no C recurrence here: {linear_attention.kernel().unavailable_reason()}")
    return request.param


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_prefill_whole_and_in_chunks_matches_transformers(kind, recurrence):
    hf = hybrid_hf_model(kind)
    ref = _hf_logits(hf, PROMPT)
    runner = _runner(hf)
    table = runner.new_table()
    whole = _feed(runner, table, PROMPT)
    assert (whole - ref).abs().max().item() < 1e-4
    table.free()
    chunks, at = [], 0
    for n in (4, 1, 3, 2, 1):  # chunked prefill, then one-token decode steps
        chunks.append(_feed(runner, table, PROMPT[at:at + n]))
        at += n
    assert (torch.cat(chunks) - ref).abs().max().item() < 1e-4
    table.free()
    assert runner.states.pool.num_free == 4 and runner.pool.num_free == runner.pool.num_blocks


def test_sequences_in_one_forward_keep_their_own_states():
    hf = hybrid_hf_model("dense")
    runner = _runner(hf)
    a, b = runner.new_table(), runner.new_table()
    other = [9, 8, 7, 6, 5, 4, 3]
    a.ensure_slots(len(PROMPT)), b.ensure_slots(len(other))
    runner.forward([Window(a, PROMPT[:6], 0), Window(b, other[:2], 0)])
    logits = runner.forward([Window(a, PROMPT[6:], 1), Window(b, other[2:], 1)])
    assert (logits[0] - _hf_logits(hf, PROMPT)[-1]).abs().max().item() < 1e-4
    assert (logits[1] - _hf_logits(hf, other)[-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["moe", "qwen3.5"])
@pytest.mark.parametrize("kept", [0, 1, 3, 4])
def test_a_rolled_back_verify_window_decodes_on_from_the_kept_rows(kept, kind, recurrence):
    """A 5-row verify window (the last token + 4 drafts), `kept` drafts accepted: truncating the
    table is all the rollback; the next token's logits are transformers' on the kept tokens."""
    hf = hybrid_hf_model(kind)
    runner = _runner(hf)
    table = runner.new_table()
    _feed(runner, table, PROMPT[:-1], 0)
    drafts = [40, 41, 42, 43]
    window = _feed(runner, table, [PROMPT[-1], *drafts])
    assert (window - _hf_logits(hf, PROMPT + drafts)[-5:]).abs().max().item() < 1e-4
    table.truncate(len(PROMPT) + kept)
    nxt = _feed(runner, table, [77])
    ref = _hf_logits(hf, PROMPT + drafts[:kept] + [77])[-1]
    assert (nxt[0] - ref).abs().max().item() < 1e-4


def test_a_rollback_past_the_kept_states_fails_clearly():
    hf = hybrid_hf_model("dense")
    runner = _runner(hf, depth=3)
    table = runner.new_table()
    _feed(runner, table, PROMPT)  # states kept after lengths 9, 10, 11
    table.truncate(7)
    with pytest.raises(RuntimeError, match="as of 7 tokens is not kept"):
        _feed(runner, table, [1])


def test_trees_are_refused_over_linear_attention():
    runner = _runner(hybrid_hf_model("dense"))
    table = runner.new_table()
    table.ensure_slots(4)
    with pytest.raises(ValueError, match="trees over linear attention"):
        runner.forward([Window(table, [1, 2, 3], 3, parents=[-1, 0, 0])])


def test_the_ring_reuses_stale_entries_first_and_marks_writes_before_they_happen():
    cache = RecurrentStateCache(StateSpec(1, 4, 2, 1, 2, 2), num_slots=1, depth=4)
    slot = cache.pool.allocate()
    cache.batch([slot], [0], [6]).commit()
    assert cache.positions[slot] == [3, 4, 5, 6]
    batch = cache.batch([slot], [4], [6])  # rolled back to 4: 5 and 6 rewritten over the stale 5, 6
    assert sorted(j for j, _ in batch.writes[0]) == [2, 3]
    assert cache.positions[slot] == [3, 4, -1, -1]  # a failed forward leaves no wrong claim
    batch.commit()
    assert cache.positions[slot] == [3, 4, 5, 6]
    cache.release(slot)
    assert cache.pool.num_free == 1 and cache.positions[slot] == [-1] * 4


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_gguf_as_llama_cpp_writes_it_gives_transformers_logits(kind, tmp_path, monkeypatch):
    """`qwen3next` / `qwen35` / `qwen35moe` files (norms as 1 + w, A as -exp(A_log), Qwen3-Next's
    projections split, Qwen3.5's value heads tiled: `write_hybrid_gguf`) load as the model they
    hold; teacher-forced logits over a prompt and its continuation are transformers'; greedy
    speculative (the file as its own draft) equals target-only."""
    from specdec import Engine, EngineConfig, SamplingParams
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.hybrid_models import write_hybrid_gguf

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tiny_tokenizer()
    hf = hybrid_hf_model(kind, vocab_size=len(tokenizer), linear_num_value_heads=4, linear_num_key_heads=2)
    path = tmp_path / f"{kind}.gguf"
    write_hybrid_gguf(hf, path, tokenizer)
    engine = Engine(EngineConfig(target=str(path), proposer="none", dtype="float32", num_blocks=64, block_size=4))
    ids = [5, 17, 33, 8, 61, 9, 42, 11, 70, 3, 25, 90, 14, 2, 66, 7]
    table = engine.target.new_table()
    table.ensure_slots(len(ids))
    got = engine.target.forward([Window(table, ids, len(ids))])
    assert (got - _hf_logits(hf, ids)).abs().max().item() < 1e-4
    table.free()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = engine.generate([ids[:7]], greedy)[0].token_ids
    spec = Engine(EngineConfig(target=str(path), draft=str(path), proposer="draft", dtype="float32", num_blocks=64,
                               block_size=4, adaptive_k=False, num_speculative_tokens=3))
    assert spec.generate([ids[:7]], greedy)[0].token_ids == plain


def _window_inputs(n: int, key_heads: int = 2, heads: int = 4, dk: int = 8, dv: int = 6, kernel: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    channels = 2 * key_heads * dk + heads * dv
    return dict(
        mixed=torch.randn(n, channels, generator=g), conv_weight=torch.randn(channels, kernel, generator=g) * 0.5,
        g=-torch.rand(n, heads, generator=g), beta=torch.rand(n, heads, generator=g),
        conv_in=torch.randn(channels, kernel - 1, generator=g), ssm_in=torch.randn(heads, dk, dv, generator=g) * 0.1,
        key_heads=key_heads, dk=dk, dv=dv,
    )


def _torch_window(mixed, conv_weight, g, beta, conv_in, ssm_in, key_heads, dk, dv, tiled, keep):
    """The torch layer's steps on one window: convolution, per value head q / k, `gated_delta_rule`."""
    n, channels = mixed.shape
    heads, width = g.shape[1], conv_weight.shape[1] - 1
    full = torch.cat([conv_in, mixed.t()], dim=-1)
    conv = torch.nn.functional.silu(torch.nn.functional.conv1d(full[None], conv_weight[:, None], groups=channels)[0]).t()
    q, k, v = conv.split([key_heads * dk, key_heads * dk, heads * dv], dim=-1)
    r = heads // key_heads
    q, k = (t.reshape(n, key_heads, dk).repeat(1, r, 1) if tiled else t.reshape(n, key_heads, dk).repeat_interleave(r, 1)
            for t in (q, k))
    out, ssm = linear_attention.gated_delta_rule(q, k, v.reshape(n, heads, dv), g, beta, ssm_in, keep)
    convs = torch.stack([full[:, i + 1: i + 1 + width] for i in range(n - keep, n)]) if keep else full.new_empty(0)
    return out, convs, ssm


def _c_window(lib, inputs: dict, tiled: bool, keep: int, start: bool = True):
    i = inputs
    channels, width = i["mixed"].shape[1], i["conv_weight"].shape[1] - 1
    heads = i["g"].shape[1]
    conv_out = [torch.full((channels, width), float("nan")) for _ in range(keep)]
    ssm_out = [torch.full((heads, i["dk"], i["dv"]), float("nan")) for _ in range(keep)]
    out = linear_attention.gated_delta_window_c(
        lib, i["mixed"], i["conv_weight"], i["g"], i["beta"], i["key_heads"], i["dk"], i["dv"], tiled,
        (i["conv_in"], i["ssm_in"]) if start else None, conv_out, ssm_out)
    return out, conv_out, ssm_out


@pytest.fixture
def c_lib():
    lib = linear_attention.load_kernel()
    if lib is None:
        pytest.skip(f"no C recurrence here: {linear_attention.kernel().unavailable_reason()}")
    return lib


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("n,keep", [(1, 1), (5, 5), (5, 2), (7, 0), (3, 1)])
def test_the_c_recurrence_equals_the_torch_one(c_lib, n, keep, tiled):
    inputs = _window_inputs(n)
    out, convs, ssms = _c_window(c_lib, inputs, tiled, keep)
    ref_out, ref_convs, ref_ssms = _torch_window(**inputs, tiled=tiled, keep=keep)
    assert (out - ref_out).abs().max().item() < 1e-5
    for j in range(keep):
        assert torch.equal(convs[j], ref_convs[j])  # the inputs moved, not computed
        assert (ssms[j] - ref_ssms[j]).abs().max().item() < 1e-5
    zero = dict(inputs, conv_in=torch.zeros_like(inputs["conv_in"]), ssm_in=torch.zeros_like(inputs["ssm_in"]))
    out0, _, _ = _c_window(c_lib, inputs, tiled, 0, start=False)  # no start state: zeros
    assert (out0 - _torch_window(**zero, tiled=tiled, keep=0)[0]).abs().max().item() < 1e-5


def test_the_c_recurrence_may_overwrite_the_state_it_started_from(c_lib):
    """The ring entry a window starts from is reused for its last row's state (`RecurrentStateCache`)."""
    inputs = _window_inputs(4)
    ref_out, ref_convs, ref_ssms = _torch_window(**inputs, tiled=False, keep=2)
    conv_in, ssm_in = inputs["conv_in"].clone(), inputs["ssm_in"].clone()
    other = (torch.empty_like(conv_in), torch.empty_like(ssm_in))
    out = linear_attention.gated_delta_window_c(
        c_lib, inputs["mixed"], inputs["conv_weight"], inputs["g"], inputs["beta"], 2, 8, 6, False, (conv_in, ssm_in),
        [other[0], conv_in], [other[1], ssm_in])
    assert (out - ref_out).abs().max().item() < 1e-5
    assert torch.equal(conv_in, ref_convs[1]) and (ssm_in - ref_ssms[1]).abs().max().item() < 1e-5


def test_a_row_of_the_c_recurrence_does_not_depend_on_its_window_nor_on_the_level(c_lib):
    """A verify window's rows equal the same rows decoded one by one, bitwise (greedy speculation =
    target-only), and every level's build returns the same bits."""
    inputs = _window_inputs(6, seed=3)
    whole, _, whole_ssm = _c_window(c_lib, inputs, False, 1)
    rows, state = [], (inputs["conv_in"], inputs["ssm_in"])
    for t in range(6):
        step = dict(inputs, mixed=inputs["mixed"][t:t + 1].contiguous(), g=inputs["g"][t:t + 1].contiguous(),
                    beta=inputs["beta"][t:t + 1].contiguous(), conv_in=state[0], ssm_in=state[1])
        out, conv, ssm = _c_window(c_lib, step, False, 1)
        rows.append(out)
        state = (conv[0], ssm[0])
    assert torch.equal(torch.cat(rows), whole) and torch.equal(state[1], whole_ssm[0])
    from specdec import native

    levels = [lv.name for lv in native.machine_levels() if lv.name in native.allowed_levels()]
    for name in levels:
        lib = linear_attention.load_kernel(name)
        if lib is not None:
            assert torch.equal(_c_window(lib, inputs, False, 1)[0], whole), name


def test_the_c_recurrence_refuses_wrong_shapes(c_lib):
    inputs = _window_inputs(3)
    with pytest.raises(ValueError, match="conv_weight must have shape"):
        linear_attention.gated_delta_window_c(c_lib, inputs["mixed"], inputs["conv_weight"][:-1].contiguous(),
                                              inputs["g"], inputs["beta"], 2, 8, 6, False, None, [], [])
    with pytest.raises(ValueError, match="4 conv and 4 ssm states to write after a window of 3 rows"):
        _c_window(c_lib, inputs, False, 4)
