"""Built-in tiny diffusers pipelines with random weights, built offline from configs
(and ``tiny-digits``, whose trained weights ship with the package: :mod:`cocodiff.runtime.digits`).

Nothing here touches the network: every component (transformer, VAE, text encoders, tokenizers,
scheduler) is constructed from an in-code config, and every weight comes from a fixed seed, so
two builds in two processes (two Ulysses ranks) hold bit-identical weights.

The shapes keep the real models' structure (joint or cross attention, RoPE layout, VAE
compression, latent channels) at toy sizes: 4 attention heads everywhere, so 1, 2 and 4 Ulysses
ranks split heads evenly. Each model's family record (:mod:`cocodiff.models.families`) names
its builder here and its default size, which makes image-token counts divisible by 4.
"""


from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from cocodiff.runtime.tiny.text import (
    NUM_HEADS,
    _clip_text_config,
    _qwen_text_encoder,
    _t5_config,
    tiny_clip_tokenizer,
    tiny_qwen_tokenizer,
    tiny_t5_tokenizer,
)

SEED = 0
HEAD_DIM = 16
INNER_DIM = NUM_HEADS * HEAD_DIM  # 64


# ---------------------------------------------------------------------------------------------
# VAEs


def _autoencoder_kl(latent_channels: int, **config) -> AutoencoderKL:
    """An 8x-downsampling AutoencoderKL with 8-channel blocks."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=128,
        **config,
    )


# ---------------------------------------------------------------------------------------------
# Pipelines


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Builds a module from a fresh generator state, leaving the caller's RNG untouched.

    Each component is seeded on its own so that changing one config does not change the
    weights of the others.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build().eval()


def _flow_match_scheduler(**config) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **config)


def build_flux() -> FluxPipeline:
    """FLUX.1-dev-shaped: 1 double + 1 single block, guidance-distilled, CLIP + T5 text."""
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=NUM_HEADS,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    )
    return FluxPipeline(
        scheduler=_flow_match_scheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        vae=_seeded(
            lambda: _autoencoder_kl(
                16,
                use_quant_conv=False,
                use_post_quant_conv=False,
                scaling_factor=0.3611,
                shift_factor=0.1159,
            )
        ),
        text_encoder=_seeded(lambda: CLIPTextModel(_clip_text_config(clip_tokenizer, 32))),
        tokenizer=clip_tokenizer,
        text_encoder_2=_seeded(lambda: T5EncoderModel(_t5_config(t5_tokenizer, 32))),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def build_sd3() -> StableDiffusion3Pipeline:
    """SD3.5-shaped: 1 joint block with RMSNorm on Q/K, two CLIPs + T5 text."""
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=16,
            num_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=NUM_HEADS,
            joint_attention_dim=64,  # T5 width; CLIP states (2 x 32) are zero-padded to it
            caption_projection_dim=INNER_DIM,
            pooled_projection_dim=64,  # the two CLIP projections (32 + 32) concatenated
            out_channels=16,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
        )
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=_flow_match_scheduler(shift=3.0),
        vae=_seeded(
            lambda: _autoencoder_kl(
                16,
                use_quant_conv=False,
                use_post_quant_conv=False,
                scaling_factor=1.5305,
                shift_factor=0.0609,
            )
        ),
        text_encoder=_seeded(
            lambda: CLIPTextModelWithProjection(_clip_text_config(clip_tokenizer, 32))
        ),
        tokenizer=clip_tokenizer,
        text_encoder_2=_seeded(
            lambda: CLIPTextModelWithProjection(_clip_text_config(clip_tokenizer, 32))
        ),
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=_seeded(lambda: T5EncoderModel(_t5_config(t5_tokenizer, 64))),
        tokenizer_3=t5_tokenizer,
    )


def build_qwen() -> QwenImagePipeline:
    """Qwen-Image-shaped: 1 double-stream block, Qwen2.5-VL text encoder, 3D-causal VAE."""
    tokenizer = tiny_qwen_tokenizer()
    transformer = _seeded(
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,  # 16 latent channels packed 2x2
            out_channels=16,
            num_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=NUM_HEADS,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
    )
    return QwenImagePipeline(
        scheduler=_flow_match_scheduler(
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        vae=_seeded(
            lambda: AutoencoderKLQwenImage(
                base_dim=8,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            )
        ),
        text_encoder=_seeded(lambda: _qwen_text_encoder(tokenizer, 32)),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_wan() -> WanPipeline:
    """Wan2.1-T2V-shaped: 1 block (self-attention with 3D RoPE + cross-attention), UMT5 text."""
    tokenizer = tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=NUM_HEADS,
            attention_head_dim=HEAD_DIM,  # RoPE: 8 dims for time, 4 each for height and width
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=2 * INNER_DIM,
            num_layers=1,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        )
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(lambda: UMT5EncoderModel(_t5_config(tokenizer, 32, UMT5Config))),
        vae=_seeded(
            lambda: AutoencoderKLWan(
                base_dim=8,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            )
        ),
        scheduler=_flow_match_scheduler(shift=3.0),
        transformer=transformer,
    )


def pixart_scheduler() -> DPMSolverMultistepScheduler:
    """PixArt-Sigma's own scheduler (DPM-Solver++ on a linear beta schedule, epsilon
    prediction), for every tiny PixArt pipeline."""
    return DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001,
                                       beta_end=0.02, num_train_timesteps=1000,
                                       prediction_type="epsilon", solver_order=2)


def build_pixart() -> PixArtSigmaPipeline:
    """PixArt-Sigma-shaped: 1 block (self-attention + cross-attention to T5), SD VAE."""
    tokenizer = tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: PixArtTransformer2DModel(
            num_attention_heads=NUM_HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=8,  # learned sigma: the pipeline keeps the first 4 channels
            num_layers=1,
            cross_attention_dim=INNER_DIM,
            sample_size=16,
            patch_size=2,
            caption_channels=32,
            interpolation_scale=1,
        )
    )
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(lambda: T5EncoderModel(_t5_config(tokenizer, 32))),
        vae=_seeded(lambda: _autoencoder_kl(4, scaling_factor=0.13025)),
        transformer=transformer,
        scheduler=pixart_scheduler(),
    )

