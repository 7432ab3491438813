"""Writes a tiny random-weight LLaMA-architecture GGUF model that llama.cpp
loads and runs (its output is gibberish; a real load and a real completion
are what the test needs). No download: everything is made here.

Usage: make_model.py OUT.gguf --embd N --layers N [--ff N] [--heads N] [--kv-heads N]
"""

import argparse

import gguf
import numpy as np


def vocabulary():
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(6)
    words = ["▁" + w for w in "the a of and to in is it you that he was for on are with as his they be at one have this from".split()]
    words += list("abcdefghijklmnopqrstuvwxyz") + ["▁" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    # Each piece once: llama.cpp refuses a vocabulary with duplicates.
    words = list(dict.fromkeys(words))
    for i, w in enumerate(words):
        tokens.append(w)
        scores.append(-float(i))
        types.append(1)
    return tokens, scores, types


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=0)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    a = p.parse_args()
    n_ff = a.ff or a.embd * 11 // 4
    head_dim = a.embd // a.heads
    n_kv = head_dim * a.kv_heads
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(7)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("residentd test model")
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # mostly f16
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    ones = np.ones(a.embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(len(tokens), a.embd))
    for i in range(a.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(a.embd, a.embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(n_kv, a.embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(n_kv, a.embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(a.embd, a.embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, a.embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, a.embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(a.embd, n_ff))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(len(tokens), a.embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
