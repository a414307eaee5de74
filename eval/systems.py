"""The systems `bench latency` times, each behind `decode(token_ids, max_tokens) -> RequestTrace`.

Our engine at k = 0 and at k, transformers `generate()` plain and assisted (`assistant_model=`)
on the same converted weights, and llama.cpp (llama-cpp-python) on the target's GGUF. Each
decodes greedily exactly `max_tokens` new tokens and stamps every chunk it emits.
"""

from __future__ import annotations

import time

import torch

from specdec.eval.metrics import RequestTrace
from specdec.eval.runner import run_request
from specdec.sampling_params import SamplingParams

SYSTEMS = ("specdec-target-only", "specdec-speculative", "transformers", "transformers-assisted", "llama.cpp")
LLAMA_CPP_INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
    "pip install llama-cpp-python"
)


class SpecdecDecoder:
    """Our engine, at most k drafts per step (0 = target-only); greedy unless a temperature is set."""

    def __init__(self, engine, k: int, temperature: float = 0.0) -> None:
        self.engine, self.k, self.temperature = engine, k, temperature
        self.runs = 0

    def decode(self, token_ids: list[int], max_tokens: int) -> RequestTrace:
        self.runs += 1  # seeded per run: both of our systems see the same seeds
        params = SamplingParams(
            temperature=self.temperature, max_tokens=max_tokens, ignore_eos=True, seed=self.runs
        )
        return run_request(self.engine, token_ids, params, self.k)[0]


class TimingStreamer:
    """A transformers streamer that stamps each pushed chunk (the first push is the prompt)."""

    def __init__(self, trace: RequestTrace) -> None:
        self.trace, self.seen_prompt = trace, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.trace.add_chunk(time.perf_counter(), value.numel())

    def end(self) -> None:
        pass


class TransformersDecoder:
    """`model.generate()`, exactly `max_tokens` new tokens, greedy unless a temperature is set;
    assisted when given a draft."""

    def __init__(self, model, assistant=None, temperature: float = 0.0) -> None:
        self.model, self.assistant, self.temperature = model, assistant, temperature

    def generation_kwargs(self, max_tokens: int) -> dict:
        eos = self.model.config.eos_token_id
        sampling = (
            dict(do_sample=True, temperature=self.temperature, top_k=None, top_p=1.0)
            if self.temperature > 0 else dict(do_sample=False)
        )
        return dict(
            **sampling, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            eos_token_id=eos, pad_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    @torch.inference_mode()
    def decode(self, token_ids: list[int], max_tokens: int) -> RequestTrace:
        input_ids = torch.tensor([token_ids], device=self.model.device)
        trace = RequestTrace(time.perf_counter(), prompt_tokens=len(token_ids))
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids),
            assistant_model=self.assistant, streamer=TimingStreamer(trace),
            **self.generation_kwargs(max_tokens),
        )
        trace.token_ids = out[0, len(token_ids):].tolist()
        return trace


class LlamaCppDecoder:
    """llama.cpp through llama-cpp-python: token loop (greedy unless a temperature is set), prompt
    cache reset before each run."""

    def __init__(self, llm, temperature: float = 0.0) -> None:
        self.llm, self.temperature = llm, temperature

    def decode(self, token_ids: list[int], max_tokens: int) -> RequestTrace:
        self.llm.reset()  # no reuse of the previous run's prompt KV: every system prefills
        trace = RequestTrace(time.perf_counter(), prompt_tokens=len(token_ids))
        t = self.temperature
        tokens = self.llm.generate(
            token_ids, top_k=1 if t == 0 else 0, top_p=1.0, min_p=0.0, temp=t, repeat_penalty=1.0
        )
        for token in tokens:
            trace.add_chunk(time.perf_counter(), 1)
            trace.token_ids.append(int(token))
            if len(trace.token_ids) >= max_tokens:
                break
        return trace


# ---- loading ---------------------------------------------------------------------------------


def load_decoders(
    engine, config, names: list[str], gguf: str | None, threads: int, context_len: int,
    temperature: float = 0.0,
) -> tuple[dict, dict[str, str]]:
    """The requested systems that can run here (in `SYSTEMS` order), and why any other cannot."""
    t = temperature
    decoders: dict = {}
    skipped: dict[str, str] = {}
    wanted = set(names)
    if "specdec-target-only" in wanted:
        decoders["specdec-target-only"] = SpecdecDecoder(engine, 0, t)
    if "specdec-speculative" in wanted:
        if engine.proposer is None:
            skipped["specdec-speculative"] = "the engine has no proposer (--no-speculation)"
        else:
            decoders["specdec-speculative"] = SpecdecDecoder(engine, config.num_speculative_tokens, t)
    if wanted & {"transformers", "transformers-assisted"}:
        target = load_transformers(config.target, config)
        if "transformers" in wanted:
            decoders["transformers"] = TransformersDecoder(target, temperature=t)
        if "transformers-assisted" in wanted:
            if not config.draft:
                skipped["transformers-assisted"] = "no draft model"
            else:
                draft = load_transformers(config.draft, config)
                decoders["transformers-assisted"] = TransformersDecoder(target, draft, t)
    if "llama.cpp" in wanted:
        llm, reason = load_llama_cpp(config, gguf, threads, context_len)
        if llm is None:
            skipped["llama.cpp"] = reason
        else:
            decoders["llama.cpp"] = LlamaCppDecoder(llm, t)
    return {name: decoders[name] for name in SYSTEMS if name in decoders}, skipped


def load_transformers(spec: str, config):
    """The same weights our engine runs, as a transformers model in the same dtype and device."""
    from transformers import AutoModelForCausalLM

    from specdec.target.model_files import resolve_model, transformers_weights
    from specdec.target.model_weights import parse_dtype

    folder = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(config.dtype), **transformers_weights(folder))
    return model.to(config.resolved_device()).eval()


def gguf_for(config, gguf: str | None) -> str | None:
    """The GGUF llama.cpp runs: --gguf, else the target's own GGUF (default pair or a .gguf spec)."""
    if gguf:
        return gguf
    if config.target == "default-target":
        from specdec.target.default_pair import default_target_gguf

        return str(default_target_gguf())
    return config.target if config.target.lower().endswith(".gguf") else None


def load_llama_cpp(config, gguf: str | None, threads: int, context_len: int):
    """(Llama, "") or (None, why not)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, f"llama-cpp-python is not installed (optional: {LLAMA_CPP_INSTALL})"
    path = gguf_for(config, gguf)
    if path is None:
        return None, "the target is not a GGUF file; pass --gguf FILE"
    llm = Llama(model_path=path, n_ctx=context_len, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    return llm, ""
