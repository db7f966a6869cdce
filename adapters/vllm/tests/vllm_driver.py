"""A vLLM instance driven over stdin/stdout, for the end-to-end tests (runs under .venv-vllm's python).

    python vllm_driver.py make-model DIR            # tiny random Llama (config.json + model.safetensors)
    python vllm_driver.py serve CONFIG_JSON         # then one JSON command per stdin line

Commands: ``{"cmd": "generate", "requests": [{"prompt": [ids], "max_tokens": n, "params": {...}}]}`` answers
``{"outputs": [{"tokens": [...], "params": {...} | null, "finish": "length" | ...}]}``; ``{"cmd": "quit"}``.
Answers are the stdout lines starting with ``KVB-JSON `` (vLLM logs elsewhere on stdout/stderr are ignored).
"""

from __future__ import annotations

import json
import os
import sys


def make_model(path: str) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    hidden, layers, heads, kv_heads, head_dim, inter, vocab = 256, 2, 4, 2, 64, 512, 1024
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "intermediate_size": inter, "vocab_size": vocab,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rnd(vocab, hidden, std=1.0), "model.norm.weight":
               torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": rnd(vocab, hidden, std=0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, hidden),
                    p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": rnd(inter, hidden),
                    p + "mlp.up_proj.weight": rnd(inter, hidden),
                    p + "mlp.down_proj.weight": rnd(hidden, inter)}
    save_file(tensors, os.path.join(path, "model.safetensors"))


def answer(obj: object) -> None:
    sys.stdout.write("KVB-JSON " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(config: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = {"model": config["model"], "skip_tokenizer_init": True, "enforce_eager": True,
                    "max_model_len": 256, "block_size": 32, "tensor_parallel_size": config.get("tp", 1),
                    "distributed_executor_backend": "mp" if config.get("tp", 1) > 1 else "uni",
                    "max_num_seqs": 16, "seed": 0, "kv_cache_memory_bytes": 64 << 20}
    if config.get("role"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge_vllm.connector",
            "kv_role": config["role"], "kv_connector_extra_config": config.get("extra", {}),
            "kv_load_failure_policy": config.get("failure_policy", "fail")}
    llm = LLM(**kwargs)
    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        prompts, params = [], []
        for req in cmd["requests"]:
            prompts.append(TokensPrompt(prompt_token_ids=req["prompt"]))
            extra = {"kv_transfer_params": req["params"]} if req.get("params") else None
            params.append(SamplingParams(temperature=0, max_tokens=req["max_tokens"], ignore_eos=True,
                                         detokenize=False, extra_args=extra))
        outs = llm.generate(prompts, params, use_tqdm=False)
        answer({"outputs": [{"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
                             "finish": o.outputs[0].finish_reason} for o in outs]})
    answer({"bye": True})
    os._exit(0)     # vLLM's teardown of worker processes can outlive the test's patience; the test reaps


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2])
    else:
        serve(json.loads(sys.argv[2]))
