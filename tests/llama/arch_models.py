"""Writes tiny random-weight GGUF models of the architectures whose KV
cache or recurrent state residentd sizes differently from a plain llama:
sliding-window attention (gemma2, gemma3), MLA (deepseek2), recurrent
state (mamba, rwkv6), a hybrid (jamba), and a vision projector (clip, as
llama-server's --mmproj takes it). llama.cpp loads each and reports its
buffers; crates/resident-config/tests/gguf.rs holds what it reported.

Each model's geometry is in GEOMETRY below; the Rust table tests build
the same headers. Weights are f32 noise: nothing here is meant to run
well, only to load.

Usage: arch_models.py OUT_DIR [NAME ...]
"""

import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model import vocabulary  # noqa: E402

T = gguf.MODEL_TENSOR
rng = np.random.default_rng(7)


class Model:
    def __init__(self, path, arch):
        self.arch = arch
        self.w = gguf.GGUFWriter(path, arch)
        self.w.add_name(f"residentd {arch} test model")

    def key(self, name, value):
        """`{arch}.name`, typed by the value: int → u32, list → array."""
        full = f"{self.arch}.{name}"
        if isinstance(value, list):
            self.w.add_array(full, value)
        elif isinstance(value, float):
            self.w.add_float32(full, value)
        else:
            self.w.add_uint32(full, value)

    def tensor(self, kind, ne, bid=None, suffix="weight", name=None):
        """A tensor of ggml shape `ne` (innermost first)."""
        if name is None:
            name = gguf.TENSOR_NAMES[kind].format(bid=bid)
            if suffix:
                name += "." + suffix
        shape = tuple(reversed(ne))
        self.w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def vocab(self):
        tokens, scores, types = vocabulary()
        self.w.add_tokenizer_model("llama")
        self.w.add_token_list(tokens)
        self.w.add_token_scores(scores)
        self.w.add_token_types(types)
        self.w.add_unk_token_id(0)
        self.w.add_bos_token_id(1)
        self.w.add_eos_token_id(2)
        return len(tokens)

    def close(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def common(m, g):
    m.key("context_length", g["ctx_train"])
    m.key("embedding_length", g["embd"])
    m.key("block_count", g["layers"])
    if "ff" in g:
        m.key("feed_forward_length", g["ff"])
    m.key("attention.head_count", g.get("heads", 0))
    if "kv_heads" in g:
        m.key("attention.head_count_kv", g["kv_heads"])
    m.key("attention.layer_norm_rms_epsilon", 1e-5)
    return m.vocab()


def gemma(path, arch, g):
    m = Model(path, arch)
    n_vocab = common(m, g)
    e, hd, ff = g["embd"], g["head_dim"], g["ff"]
    m.key("attention.key_length", hd)
    m.key("attention.value_length", hd)
    m.key("attention.sliding_window", g["window"])
    m.tensor(T.TOKEN_EMBD, [e, n_vocab])
    m.tensor(T.OUTPUT_NORM, [e])
    for i in range(g["layers"]):
        m.tensor(T.ATTN_NORM, [e], i)
        m.tensor(T.ATTN_Q, [e, hd * g["heads"]], i)
        m.tensor(T.ATTN_K, [e, hd * g["kv_heads"]], i)
        m.tensor(T.ATTN_V, [e, hd * g["kv_heads"]], i)
        m.tensor(T.ATTN_OUT, [hd * g["heads"], e], i)
        m.tensor(T.ATTN_POST_NORM, [e], i)
        if arch == "gemma3":
            m.tensor(T.ATTN_K_NORM, [hd], i)
            m.tensor(T.ATTN_Q_NORM, [hd], i)
        m.tensor(T.FFN_NORM, [e], i)
        m.tensor(T.FFN_GATE, [e, ff], i)
        m.tensor(T.FFN_UP, [e, ff], i)
        m.tensor(T.FFN_DOWN, [ff, e], i)
        m.tensor(T.FFN_POST_NORM, [e], i)
    m.close()


def deepseek2(path, g):
    """MLA as convert_hf_to_gguf writes it now: one KV head whose key is
    the compressed latent plus the rope part, key_length_mla and
    value_length_mla the per-head sizes before compression."""
    m = Model(path, "deepseek2")
    n_vocab = common(m, g)
    e, h, ff = g["embd"], g["heads"], g["ff"]
    rank, rope = g["kv_lora_rank"], g["rope"]
    k_mla, v_mla = g["key_length_mla"], g["value_length_mla"]
    m.key("attention.key_length", rank + rope)
    m.key("attention.value_length", rank)
    m.key("attention.key_length_mla", k_mla)
    m.key("attention.value_length_mla", v_mla)
    m.key("attention.kv_lora_rank", rank)
    m.key("attention.q_lora_rank", 0)
    m.key("rope.dimension_count", rope)
    m.key("leading_dense_block_count", g["layers"])
    m.key("expert_feed_forward_length", ff)
    m.key("expert_shared_count", 1)
    m.key("expert_count", 0)
    m.key("expert_used_count", 0)
    m.tensor(T.TOKEN_EMBD, [e, n_vocab])
    m.tensor(T.OUTPUT_NORM, [e])
    for i in range(g["layers"]):
        m.tensor(T.ATTN_NORM, [e], i)
        m.tensor(T.ATTN_KV_A_NORM, [rank], i)
        m.tensor(T.ATTN_Q, [e, h * k_mla], i)
        m.tensor(T.ATTN_KV_A_MQA, [e, rank + rope], i)
        m.tensor(T.ATTN_K_B, [k_mla - rope, rank, h], i)
        m.tensor(T.ATTN_V_B, [rank, v_mla, h], i)
        m.tensor(T.ATTN_OUT, [h * v_mla, e], i)
        m.tensor(T.FFN_NORM, [e], i)
        m.tensor(T.FFN_GATE, [e, ff], i)
        m.tensor(T.FFN_DOWN, [ff, e], i)
        m.tensor(T.FFN_UP, [e, ff], i)
    m.close()


def mamba_layer(m, g, i, jamba=False):
    e, di, ds, dc, dt = g["embd"], g["d_inner"], g["d_state"], g["d_conv"], g["dt_rank"]
    m.tensor(T.SSM_IN, [e, 2 * di], i)
    m.tensor(T.SSM_CONV1D, [dc, di], i)
    m.tensor(T.SSM_CONV1D, [di], i, suffix="bias")
    m.tensor(T.SSM_X, [di, dt + 2 * ds], i)
    if jamba:
        m.tensor(T.SSM_DT_NORM, [dt], i)
        m.tensor(T.SSM_B_NORM, [ds], i)
        m.tensor(T.SSM_C_NORM, [ds], i)
    m.tensor(T.SSM_DT, [dt, di], i)
    m.tensor(T.SSM_DT, [di], i, suffix="bias")
    m.tensor(T.SSM_A, [ds, di], i, suffix=None)
    m.tensor(T.SSM_D, [di], i, suffix=None)
    m.tensor(T.SSM_OUT, [di, e], i)


def ssm_keys(m, g):
    m.key("ssm.conv_kernel", g["d_conv"])
    m.key("ssm.inner_size", g["d_inner"])
    m.key("ssm.state_size", g["d_state"])
    m.key("ssm.time_step_rank", g["dt_rank"])


def mamba(path, g):
    m = Model(path, "mamba")
    n_vocab = common(m, g)
    ssm_keys(m, g)
    e = g["embd"]
    m.tensor(T.TOKEN_EMBD, [e, n_vocab])
    m.tensor(T.OUTPUT_NORM, [e])
    for i in range(g["layers"]):
        m.tensor(T.ATTN_NORM, [e], i)
        mamba_layer(m, g, i)
    m.close()


def jamba(path, g):
    """Attention on the layers whose head_count_kv is not 0, Mamba on
    the others."""
    m = Model(path, "jamba")
    g = dict(g)
    kv = g.pop("kv_heads")
    n_vocab = common(m, g)
    m.key("attention.head_count_kv", kv)
    ssm_keys(m, g)
    e, ff, h = g["embd"], g["ff"], g["heads"]
    hd = e // h
    m.tensor(T.TOKEN_EMBD, [e, n_vocab])
    m.tensor(T.OUTPUT_NORM, [e])
    for i in range(g["layers"]):
        m.tensor(T.ATTN_NORM, [e], i)
        if kv[i] == 0:
            mamba_layer(m, g, i, jamba=True)
        else:
            m.tensor(T.ATTN_Q, [e, e], i)
            m.tensor(T.ATTN_K, [e, hd * kv[i]], i)
            m.tensor(T.ATTN_V, [e, hd * kv[i]], i)
            m.tensor(T.ATTN_OUT, [e, e], i)
        m.tensor(T.FFN_NORM, [e], i)
        m.tensor(T.FFN_GATE, [e, ff], i)
        m.tensor(T.FFN_DOWN, [ff, e], i)
        m.tensor(T.FFN_UP, [e, ff], i)
    m.close()


def rwkv6(path, g):
    m = Model(path, "rwkv6")
    n_vocab = common(m, g)
    e, ff, hs = g["embd"], g["ff"], g["head_size"]
    mix, decay = g["time_mix_extra_dim"], g["time_decay_extra_dim"]
    m.key("wkv.head_size", hs)
    m.key("time_mix_extra_dim", mix)
    m.key("time_decay_extra_dim", decay)
    m.key("rescale_every_n_layers", 6)
    m.key("attention.layer_norm_epsilon", 1e-5)
    m.tensor(T.TOKEN_EMBD, [e, n_vocab])
    m.tensor(T.TOKEN_EMBD_NORM, [e], 0)
    m.tensor(T.TOKEN_EMBD_NORM, [e], 0, suffix="bias")
    m.tensor(T.OUTPUT_NORM, [e])
    m.tensor(T.OUTPUT_NORM, [e], suffix="bias")
    m.tensor(T.OUTPUT, [e, n_vocab])
    for i in range(g["layers"]):
        for kind in (T.ATTN_NORM, T.ATTN_NORM_2, T.TIME_MIX_LN):
            m.tensor(kind, [e], i)
            m.tensor(kind, [e], i, suffix="bias")
        m.tensor(T.TIME_MIX_W1, [e, mix * 5], i)
        m.tensor(T.TIME_MIX_W2, [mix, e, 5], i)
        m.tensor(T.TIME_MIX_LERP_X, [e, 1, 1], i)
        m.tensor(T.TIME_MIX_LERP_FUSED, [e, 1, 1, 5], i)
        m.tensor(T.TIME_MIX_FIRST, [hs, e // hs], i)
        m.tensor(T.TIME_MIX_DECAY, [e], i)
        m.tensor(T.TIME_MIX_DECAY_W1, [e, decay], i)
        m.tensor(T.TIME_MIX_DECAY_W2, [decay, e], i)
        for kind in (T.TIME_MIX_KEY, T.TIME_MIX_VALUE, T.TIME_MIX_RECEPTANCE, T.TIME_MIX_GATE):
            m.tensor(kind, [e, e], i)
        m.tensor(T.TIME_MIX_OUTPUT, [e, e], i)
        m.tensor(T.CHANNEL_MIX_LERP_K, [e, 1, 1], i)
        m.tensor(T.CHANNEL_MIX_LERP_R, [e, 1, 1], i)
        m.tensor(T.CHANNEL_MIX_KEY, [e, ff], i)
        m.tensor(T.CHANNEL_MIX_VALUE, [ff, e], i)
        m.tensor(T.CHANNEL_MIX_RECEPTANCE, [e, e], i)
    m.close()


def mmproj(path, g):
    """A LLaVA-style vision projector (`clip`, projector type mlp): a
    vision tower of `layers` blocks and a two-layer MLP into the text
    model's embedding. llama-server --mmproj prints its "model size"."""
    w = gguf.GGUFWriter(path, "clip")
    e, ff, n = g["embd"], g["ff"], g["layers"]
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_uint32("clip.vision.embedding_length", e)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", n)
    w.add_uint32("clip.vision.projection_dim", g["proj"])
    w.add_uint32("clip.vision.attention.head_count", 4)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", g["image"])
    w.add_uint32("clip.vision.patch_size", g["patch"])
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)

    def t(name, ne):
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(ne))) * 0.02).astype(np.float32))

    p = g["patch"]
    t("v.patch_embd.weight", [p, p, 3, e])
    t("v.class_embd", [e])
    t("v.position_embd.weight", [e, (g["image"] // p) ** 2 + 1])
    t("v.pre_ln.weight", [e])
    t("v.pre_ln.bias", [e])
    for i in range(n):
        for x in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t(f"v.blk.{i}.{x}.weight", [e, e])
            t(f"v.blk.{i}.{x}.bias", [e])
        for x in ("ln1", "ln2"):
            t(f"v.blk.{i}.{x}.weight", [e])
            t(f"v.blk.{i}.{x}.bias", [e])
        t(f"v.blk.{i}.ffn_up.weight", [e, ff])
        t(f"v.blk.{i}.ffn_up.bias", [ff])
        t(f"v.blk.{i}.ffn_down.weight", [ff, e])
        t(f"v.blk.{i}.ffn_down.bias", [e])
    t("mm.0.weight", [e, g["proj"]])
    t("mm.0.bias", [g["proj"]])
    t("mm.2.weight", [g["proj"], g["proj"]])
    t("mm.2.bias", [g["proj"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The geometry of each model; the Rust table tests use the same numbers.
GEOMETRY = {
    "gemma2": dict(ctx_train=8192, embd=64, layers=4, ff=128, heads=4, kv_heads=2, head_dim=64, window=256),
    "gemma3": dict(ctx_train=8192, embd=64, layers=7, ff=128, heads=4, kv_heads=1, head_dim=32, window=512),
    "deepseek2": dict(
        ctx_train=8192, embd=64, layers=3, ff=128, heads=4, kv_heads=1,
        kv_lora_rank=64, rope=16, key_length_mla=48, value_length_mla=32,
    ),
    "mamba": dict(ctx_train=8192, embd=64, layers=3, d_conv=4, d_inner=128, d_state=16, dt_rank=4),
    "rwkv6": dict(
        ctx_train=8192, embd=64, layers=3, ff=224, head_size=16,
        time_mix_extra_dim=8, time_decay_extra_dim=16,
    ),
    "jamba": dict(
        ctx_train=8192, embd=64, layers=4, ff=128, heads=4, kv_heads=[0, 2, 0, 2],
        d_conv=4, d_inner=128, d_state=16, dt_rank=4,
    ),
    # Projects into make_model.py --embd 256's llama.
    "mmproj": dict(embd=128, ff=512, layers=4, proj=256, image=224, patch=14),
}

WRITERS = {
    "gemma2": lambda p, g: gemma(p, "gemma2", g),
    "gemma3": lambda p, g: gemma(p, "gemma3", g),
    "deepseek2": deepseek2,
    "mamba": mamba,
    "rwkv6": rwkv6,
    "jamba": jamba,
    "mmproj": mmproj,
}


def main():
    out = sys.argv[1]
    names = sys.argv[2:] or list(WRITERS)
    os.makedirs(out, exist_ok=True)
    for name in names:
        WRITERS[name](os.path.join(out, f"{name}.gguf"), GEOMETRY[name])
        print(os.path.join(out, f"{name}.gguf"))


if __name__ == "__main__":
    main()
