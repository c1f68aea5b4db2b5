"""Real models as users have them (transformers, diffusers), built from small configs: no downloads.

Each factory returns ``(model, args, kwargs)``; the model's first output is compared.
Dropout is off so a parallel run can equal one device exactly. One decoder layer, unless the
model's layers differ (Gemma2's sliding and global ones, SD3's last joint block, which keeps no
text) or the seam between two is what is checked (Llama): Dynamo's trace of each rank, most of a
launch's time, grows with the layers.
"""

from __future__ import annotations

import functools

import torch

from ..model_folders import Example, denoiser_inputs, flux_image_ids

VOCAB, BATCH, SEQ = 128, 2, 32


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    return LlamaForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def gemma2():
    """Logit soft-capping, so attention is written out: matmul, tanh, softmax, matmul. The cap is
    small so that the random model's small scores (|s| < 0.03) reach tanh's curved part: a
    parallel run that capped wrongly, forward or backward, would differ."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=0.02,
                          final_logit_softcapping=30.0, sliding_window=12, attention_dropout=0.0)
    return Gemma2ForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def gemma2_left_padded():
    """Gemma2 given a left-padded batch: its mask fills the lowest finite value, so the first
    query rows of the padded sequence see no key and attend to every key evenly."""
    model, args, kwargs = gemma2()
    return model, args, {**kwargs, "attention_mask": _left_padding()}


def _left_padding() -> torch.Tensor:
    """The second sequence of the batch starts with 5 padding positions."""
    keep = torch.ones(BATCH, SEQ, dtype=torch.long)
    keep[1, :5] = 0
    return keep


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=8, n_positions=64, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), (_ids(),), {"use_cache": False, "return_dict": False}


def qwen2():
    from transformers import Qwen2Config, Qwen2Model
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2)
    return Qwen2Model(config), (_ids(),), {"use_cache": False, "return_dict": False}


def mistral():
    from transformers import MistralConfig, MistralModel
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=4, sliding_window=12, eos_token_id=0)
    return MistralModel(config), (_ids(),), {"use_cache": False, "return_dict": False}


def mistral_padded():
    """A sliding window and a right-padded batch: the mask transformers builds ANDs both."""
    model, args, kwargs = mistral()
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, -5:] = 0
    return model, args, {**kwargs, "attention_mask": attention_mask}


def flux():
    """Joint (text + image) attention blocks and single-stream blocks."""
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    # 32 image tokens, a latent 8 x 16 packed in 2 x 2 patches
    return model, (), denoiser_inputs(model, Example(latent_height=8, latent_width=16, text_tokens=16))


def flux2():
    """FLUX.2's transformer: single-stream blocks whose one projection holds q, k, v and the MLP's
    gate and up (split, then chunked and sliced), rotary frequencies made by ``torch.outer``."""
    from diffusers import Flux2Transformer2DModel
    model = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                    timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    image, text = 32, 16
    ids = flux_image_ids(image // 8, 8).unsqueeze(0)
    ids = torch.cat([ids, torch.zeros(1, image, 1)], dim=-1)  # FLUX.2's fourth axis
    return model, (), {"hidden_states": torch.randn(1, image, 16), "encoder_hidden_states": torch.randn(1, text, 32),
                       "timestep": torch.tensor([0.5]), "img_ids": ids, "txt_ids": torch.zeros(1, text, 4),
                       "return_dict": False}


def phi3():
    """A fused qkv projection sliced by index, a fused gate_up projection."""
    from transformers import Phi3Config, Phi3Model
    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=8, num_key_value_heads=8, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return Phi3Model(config), (_ids(),), {"use_cache": False, "return_dict": False}


def gptj():
    """Rotary tables made by ``torch.repeat_interleave`` along their last dim, a rotary part of
    each head narrower than the head (``rotary_dim``), attention and MLP side by side."""
    from transformers import GPTJConfig, GPTJForCausalLM
    config = GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=8, rotary_dim=4, n_positions=64)
    return GPTJForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def bert():
    """An encoder whose pooler reads the first token (``hidden[:, 0]``)."""
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(config), (_ids(),), {"return_dict": False}


def modernbert():
    """A fused qkv viewed part first, ``(b, s, 3, heads, head_dim)``, then unbound per part."""
    from transformers import ModernBertConfig, ModernBertModel
    config = ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2)
    return ModernBertModel(config), (_ids(),), {"return_dict": False}


def wan():
    """Video tokens made inside the graph (a 3-D patch embedding), q and k normalized across
    every head at once (``rms_norm_across_heads``), RoPE written through ``setitem``."""
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=64, num_layers=1,
                                  rope_max_seq_len=32)
    return model, (), denoiser_inputs(model, Example(latent_frames=2, latent_height=8, latent_width=12, text_tokens=8))


def sd3():
    """Joint attention whose image tokens are made inside the graph (patch embedding) and whose
    text tokens come in as an input."""
    from diffusers import SD3Transformer2DModel
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    return model, (), denoiser_inputs(model, Example(text_tokens=8))  # its sample_size, 8


def bloom():
    """ALiBi scores written out by hand, ``alibi.baddbmm(batch1=q, batch2=k, beta=, alpha=)`` by keyword."""
    from transformers import BloomConfig, BloomForCausalLM
    config = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1, n_head=4, hidden_dropout=0.0,
                         attention_dropout=0.0)
    return BloomForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def mpt():
    """ALiBi counted from the last key (``slope * (k - S + 1)``, a ``[heads, 1, S]`` bias) and
    a causal ``masked_fill``, written out by hand; a fused qkv cut into thirds by ``chunk``."""
    from transformers import MptConfig, MptForCausalLM
    config = MptConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=8)
    return MptForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def llama4():
    """Experts run on every token (the tokens tiled once per expert, weighted by a sigmoid of the
    top-1 router logit, zero elsewhere, through ``bmm`` with ``[E, in, out]`` weights and summed
    back over the experts) beside a shared expert; chunked attention (a mask of 12-token chunks)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
                              num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                              num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=12,
                              interleave_moe_layer_step=1, pad_token_id=0)
    return Llama4ForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def apertus():
    """An MLP with no gate whose activation is xIELU: a ``where`` between a square and an
    ``expm1`` branch, its two parameters through ``softplus``."""
    from transformers import ApertusConfig, ApertusForCausalLM
    config = ApertusConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=4)
    return ApertusForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def t5():
    """T5 (encoder and decoder): a learned relative position bias (an embedding of buckets of
    ``k - q``, both ways in the encoder, causal in the decoder, where it is kept by the causal
    mask) passed as SDPA's mask to unscaled scores; cross-attention's bias is zeros."""
    from transformers import T5Config, T5Model
    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)
    ids = _ids()
    return T5Model(config), (ids,), {"decoder_input_ids": ids.flip(1), "use_cache": False, "return_dict": False}


def t5_padded():
    """T5 with a right-padded encoder batch and a left-padded decoder batch: its masks fill the
    lowest finite value where the padding hides keys, around the position bias."""
    model, args, kwargs = t5()
    keep = _left_padding()
    return model, args, {**kwargs, "attention_mask": keep.flip(1).contiguous(), "decoder_attention_mask": keep}


def falcon():
    """The new decoder architecture: a fused qkv viewed as (groups, q heads per group + 2, head_dim),
    a key and value per group broadcast to its query heads; ``x @ weight.T`` projections."""
    from transformers import FalconConfig, FalconForCausalLM
    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=8, num_kv_heads=2,
                          new_decoder_architecture=True, hidden_dropout=0.0, attention_dropout=0.0)
    return FalconForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def falcon_multi_query():
    """Falcon-7B's layout: multi-query, one fused qkv viewed as (heads + 2, head_dim) and split
    into the query heads, one key and one value head; attention and MLP in parallel."""
    from transformers import FalconConfig, FalconForCausalLM
    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                          multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
                          hidden_dropout=0.0, attention_dropout=0.0)
    return FalconForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def gpt_bigcode():
    """StarCoder's layout: multi-query, one fused qkv ``unsqueeze(1).split([hidden, head_dim, head_dim])``,
    the key and value head repeated to the query heads (``repeat_kv``)."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    config = GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=8, n_positions=64, multi_query=True,
                              attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPTBigCodeForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def mixtral(experts: int = 4):
    """A mixture of ``experts`` experts, top-2: batched expert weights ``[E, 2 * inter, hidden]``
    through grouped matmuls (transformers' default experts implementation), tokens sorted by expert."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts,
                           num_experts_per_tok=2)
    return MixtralForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def phimoe():
    """PhiMoE in eval mode: its sparsemixer router picks two experts one by one (a top-1 max, that
    expert scattered out of the scores, a second max; the picks concatenated), not by top-k. In
    training it samples them (Gumbel noise drawn by ``exponential_``)."""
    from transformers import PhimoeConfig, PhimoeForCausalLM
    config = PhimoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2)
    return PhimoeForCausalLM(config).eval(), (_ids(),), {"use_cache": False, "return_dict": False}


def mixtral_aux():
    """Mixtral returning its load-balancing loss (``output_router_logits``): first, before the logits.
    transformers' router-logit hooks break the graph at each router."""
    model, args, kwargs = mixtral()
    return model, args, {**kwargs, "output_router_logits": True}


def mixtral_batched_mm():
    """Mixtral's experts read a row at a time (transformers' ``batched_mm``: each row's expert
    weights gathered, ``W[expert_ids]``, then ``bmm``), which canonicalize makes grouped matmuls."""
    model, args, kwargs = mixtral()
    model.config._experts_implementation = "batched_mm"
    return model, args, kwargs


def mixtral_eager():
    """Mixtral's experts as transformers' ``eager`` implementation: a loop over the experts
    ``nonzero`` finds hit, each taking its tokens by ``torch.where``. Dynamo breaks the graph at
    ``nonzero``: the experts run between the planned graphs."""
    model, args, kwargs = mixtral()
    model.config._experts_implementation = "eager"
    return model, args, kwargs


def qwen2_moe():
    """Experts beside a shared expert (an MLP gated by a sigmoid of its own linear). The experts'
    width is the sequence's length (32): a weight dim that long starts no sequence over cp."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                            num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    return Qwen2MoeForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def deepseek_v3():
    """Multi-head latent attention (q and kv through low-rank latents, a rotary key part
    shared by every head and filled into the key slice by slice, a value head dim other
    than the query's) and a mixture of 4 experts beside a shared one, routed by a sigmoid
    over expert groups whose router reads the hidden states before they become tokens."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                              n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64)
    return DeepseekV3ForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def deepseek_v3_published():
    """One layer of DeepSeek-V3 at its published sizes (hidden 7168, 128 heads, latents of 1536
    and 512, 256 experts of 2048, top-8, one shared; the vocabulary cut), on the meta device:
    planned, never run. The tiny config's latents are a larger share of its FLOPs than the
    real model's, so this is the model whose coverage counts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                              num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=128,
                              num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                              n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                              qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=256)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def qwen3_next():
    """Qwen3-Next: a gated delta rule layer (linear attention with a recurrence over the
    sequence, in torch's chunked form) beside a full attention layer, each before a mixture of
    experts with a shared expert."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
                             layer_types=["linear_attention", "full_attention"], linear_num_key_heads=4,
                             linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             pad_token_id=0)
    return Qwen3NextForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def qwen3_5():
    """Qwen3.5: Qwen3-Next's gated delta rule with q, k and v from one projection (its parts of
    unequal sizes: 4 key heads, 8 value heads), the gate, beta and decay from projections of their
    own, beside a full attention layer."""
    from transformers import Qwen3_5TextConfig, Qwen3_5ForCausalLM
    config = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
                               layer_types=["linear_attention", "full_attention"], linear_num_key_heads=4,
                               linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
                               pad_token_id=0)
    return Qwen3_5ForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def diffllama():
    """DiffLlama: differential attention, two SDPA calls sharing q and k over the two halves of
    the value heads (each repeated), their outputs concatenated, chunked into two halves of the
    heads and combined head pair by head pair with learned lambdas, then normed per pair."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM
    config = DiffLlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    return DiffLlamaForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def gpt_oss():
    """GPT-OSS: attention with learned sink logits concatenated to the scores (written out), a
    sliding window on every other layer, and experts whose grouped matmuls add a bias gathered
    per row and interleave gate and up. The sinks are drawn larger than their init, as trained
    ones are, so that they take a real share of each softmax; the experts' biases, which
    transformers starts at zero, at random (each expert's its own, as large as the products they
    are added to): a bias added once per rank, or another expert's, would show."""
    from transformers import GptOssConfig, GptOssForCausalLM
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=12, layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.normal_(std=0.2)
    return model, (_ids(),), {"use_cache": False, "return_dict": False}


def mochi():
    """Mochi's transformer: its attention selects each sample's valid text tokens by ``nonzero``,
    a break Dynamo meets inside inlined calls, where it cannot split the frames: it runs them
    eagerly and compiles the calls they make, frame by frame."""
    from diffusers import MochiTransformer3DModel
    model = MochiTransformer3DModel(patch_size=2, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                                    pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=16,
                                    max_sequence_length=8)
    return model, (), dict(hidden_states=torch.randn(BATCH, 4, 2, 8, 8), encoder_hidden_states=torch.randn(BATCH, 8, 16),
                           timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(BATCH, 8),
                           return_dict=False)


def cogview4():
    """CogView4's transformer: joint text and image tokens, the rotary embedding written in place
    into the image part of q and k (``q[:, :, text:] = rope(q[:, :, text:])``)."""
    from diffusers import CogView4Transformer2DModel
    model = CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=16,
                                       num_attention_heads=4, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
                                       pos_embed_max_size=8, sample_size=8, rope_axes_dim=(8, 8))
    size = torch.tensor([[64.0, 64.0]] * BATCH)
    return model, (), dict(hidden_states=torch.randn(BATCH, 4, 8, 8), encoder_hidden_states=torch.randn(BATCH, 8, 16),
                           timestep=torch.tensor([10, 500]), original_size=size, target_size=size,
                           crop_coords=torch.zeros(BATCH, 2), return_dict=False)


def sana():
    """Sana's transformer: linear attention (ReLU kernels, ``v @ kT`` summed over the sequence) and
    a feed-forward of convolutions over the image grid (1 x 1, a depthwise 3 x 3, 1 x 1 gated).
    The cross-attention's key bias is frozen: its gradient is 0 in exact arithmetic (it shifts
    each query's scores by one constant), so a relative error on it is rounding over rounding."""
    from diffusers import SanaTransformer2DModel
    model = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
                                   num_layers=1, num_cross_attention_heads=4, cross_attention_head_dim=8,
                                   cross_attention_dim=32, caption_channels=16, sample_size=8, patch_size=1)
    model.transformer_blocks[0].attn2.to_k.bias.requires_grad_(False)
    return model, (), dict(hidden_states=torch.randn(BATCH, 4, 8, 8), encoder_hidden_states=torch.randn(BATCH, 8, 16),
                           timestep=torch.tensor([10, 500]), return_dict=False)


def lfm2():
    """LFM2: a short convolution layer (two gates of one input projection around a causal
    depthwise convolution of kernel 3, transformers' ``causal_conv1d_fn``) beside an attention
    layer."""
    from transformers import Lfm2Config, Lfm2ForCausalLM
    config = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                        layer_types=["conv", "full_attention"])
    return Lfm2ForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def granite_hybrid():
    """Granite 4's hybrid (GraniteMoeHybrid): a Mamba-2 layer (one projection fused ``[z, x, B, C,
    dt]`` with B and C of one group, a causal convolution over x, B and C, the chunked selective
    scan, a norm gated by z) beside an attention layer, each followed by experts and a shared MLP."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    config = GraniteMoeHybridConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                    pad_token_id=0, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                                    mamba_d_state=16, mamba_expand=2, mamba_chunk_size=8,
                                    layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                                    shared_intermediate_size=64)
    return GraniteMoeHybridForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def granite_swa():
    """Granite with sliding windows: a window of 8 in every other layer, and a learned sink
    logit per head applied after attention as a scale, ``out * sigmoid(logsumexp(scores) -
    sink)`` (GPT-OSS's sinks, written otherwise)."""
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM
    config = GraniteSWAConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              layer_rope_theta=[10000.0, 10000.0], pad_token_id=0)
    model = GraniteSWAForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # initialized to zeros
    return model, (_ids(),), {"use_cache": False, "return_dict": False}


def mimo_v2_flash():
    """MiMo-V2-Flash: attention written out whose values' heads are narrower than q's and k's
    (8 against 12), with sink logits on its sliding-window layers; experts in its second layer."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
    config = MiMoV2FlashConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=12, v_head_dim=8,
                               max_position_embeddings=64, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0)
    model = MiMoV2FlashForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.sinks.normal_()  # initialized to zeros
    return model, (_ids(),), {"use_cache": False, "return_dict": False}


def jamba():
    """Jamba: a Mamba-1 layer (one projection fused ``[x, z]``, channels first; a causal
    convolution over x; ``x_proj`` to the time steps' low-rank input, B and C, each normed;
    ``dt_proj``'s weight times the first; the selective scan, its state per channel) beside an
    attention layer followed by experts."""
    from transformers import JambaConfig, JambaForCausalLM
    config = JambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                         mamba_dt_rank=8, use_mamba_kernels=False)
    return JambaForCausalLM(config), (_ids(),), {"use_cache": False, "return_dict": False}


def unet():
    """Stable Diffusion's UNet2DConditionModel: resnet blocks of group norms and 3 x 3
    convolutions, cross-attention transformers over the image's positions, a downsampling
    convolution of stride 2 and a nearest upsampling between two resolutions."""
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                 attention_head_dim=8, norm_num_groups=8)
    return model, (), denoiser_inputs(model, Example(batch=BATCH, text_tokens=8))  # its sample_size, 16


def hidream():
    """HiDream-I1's transformer in training: Flux-like double and single-stream blocks whose
    feed-forward is a mixture of 4 experts (top-2) in an ``nn.ModuleList``, looped over with a
    mask per expert, beside a shared expert. The text is three parts (T5's, and two Llama
    layers'), the rotary positions one. Run under Dynamo's ``capture_dynamic_output_shape_ops``
    (``ONE_GRAPH``): otherwise the loop breaks the graph and Dynamo skips the model's frame."""
    from diffusers import HiDreamImageTransformer2DModel
    model = HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                           num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
                                           caption_channels=[8, 4], text_emb_dim=16, num_routed_experts=4,
                                           num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32),
                                           llama_layers=[0, 1])
    return model, (), dict(hidden_states=torch.randn(BATCH, 4, 8, 8), timesteps=torch.tensor([10, 500]),
                           encoder_hidden_states_t5=torch.randn(BATCH, 8, 8),
                           encoder_hidden_states_llama3=torch.randn(2, BATCH, 8, 4),
                           pooled_embeds=torch.randn(BATCH, 16), return_dict=False)


def ltx():
    """LTX-Video's transformer: rotary positions from a grid of frames, rows and columns made in
    the graph (``[3, frames, height, width]``, flattened to the tokens), cross-attention to a
    masked caption."""
    from diffusers import LTXVideoTransformer3DModel
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                       num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                                       num_layers=1, caption_channels=16)
    return model, (), dict(hidden_states=torch.randn(BATCH, 2 * 4 * 4, 8), encoder_hidden_states=torch.randn(BATCH, 8, 16),
                           timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(BATCH, 8),
                           num_frames=2, height=4, width=4, return_dict=False)


ONE_GRAPH = {"hidream"}
"""Models run under Dynamo's ``capture_dynamic_output_shape_ops`` (``passes.expert_loop``)."""


def checkpointing_enabled(model) -> None:
    """Gradient checkpointing on, as users turn it on for training: transformers'
    ``gradient_checkpointing_enable`` (no cache: its warning under checkpointing breaks the
    graph), diffusers' ``enable_gradient_checkpointing``."""
    model.train()
    if hasattr(model, "gradient_checkpointing_enable"):
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.enable_gradient_checkpointing()


@functools.cache
def explained(name: str, sizes: tuple[tuple[str, int], ...], checkpointed: bool = False):
    """``explain`` of the model ``name`` over the mesh ``sizes`` (with its gradient checkpointing
    on), made once: test_real_models and test_activation_checkpointing both read it."""
    import dtensor_par

    torch.manual_seed(0)
    model, args, kwargs = FACTORIES[name]()
    if checkpointed:
        checkpointing_enabled(model)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=name in ONE_GRAPH):
        return dtensor_par.explain(model, args, example_kwargs=kwargs, **dict(sizes))


FACTORIES = {"llama": llama, "gemma2": gemma2, "gemma2_left_padded": gemma2_left_padded, "t5_padded": t5_padded, "gpt2": gpt2, "qwen2": qwen2, "mistral": mistral, "mistral_padded": mistral_padded,
             "flux": flux, "phi3": phi3, "gptj": gptj, "bert": bert, "modernbert": modernbert, "wan": wan, "sd3": sd3, "bloom": bloom, "t5": t5,
             "falcon": falcon, "falcon_multi_query": falcon_multi_query, "gpt_bigcode": gpt_bigcode, "mixtral": mixtral, "mixtral_aux": mixtral_aux,
             "mixtral_batched_mm": mixtral_batched_mm, "mixtral_eager": mixtral_eager,
             "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3,
             "deepseek_v3_published": deepseek_v3_published, "gpt_oss": gpt_oss, "mpt": mpt, "apertus": apertus,
             "llama4": llama4, "mochi": mochi, "cogview4": cogview4, "sana": sana,
             "phimoe": phimoe, "hidream": hidream, "ltx": ltx, "flux2": flux2, "qwen3_next": qwen3_next,
             "qwen3_5": qwen3_5, "granite_hybrid": granite_hybrid, "jamba": jamba,
             "granite_swa": granite_swa, "mimo_v2_flash": mimo_v2_flash,
             "diffllama": diffllama, "unet": unet, "lfm2": lfm2}
